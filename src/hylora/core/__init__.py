"""The vocabulary every other part reads: typed configs, presets, overrides, errors,
the remat save-point names and the architecture's per-layer description."""
