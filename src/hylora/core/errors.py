"""Errors a user can act on: each names the field or input at fault."""


class ConfigError(ValueError):
  """A configuration field, override or mesh request is invalid."""


class DataError(ValueError):
  """Training data is invalid (bad file, token ids outside the vocabulary, ...)."""


class WeightsError(ValueError):
  """A base-weights folder is unusable (missing, unexpected, misshapen or truncated tensor)."""


class CheckpointError(ValueError):
  """A training checkpoint cannot be used (corrupted, or from a different run setup)."""


class TrainingHalted(RuntimeError):
  """The run stopped itself (e.g. too many non-finite steps in a row)."""
