"""Errors a user can act on: each names the field or input at fault."""


class ConfigError(ValueError):
  """A configuration field, override or mesh request is invalid."""


class DataError(ValueError):
  """Training data is invalid (bad file, token ids outside the vocabulary, ...)."""
