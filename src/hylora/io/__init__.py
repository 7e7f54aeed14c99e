"""Input and output: base weights and their names, training checkpoints, PEFT export,
multi-host start-up."""
