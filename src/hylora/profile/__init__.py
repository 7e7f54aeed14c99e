"""Profiling on the device: compiled schedules, device traces, profile-guided recompiles."""
