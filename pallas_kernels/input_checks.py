"""What every kernel family's input checks share: one-line ValueErrors naming the argument
and its shape, so a caller never sees a traceback from deep inside JAX."""


def require(condition: bool, message: str) -> None:
  if not condition:
    raise ValueError(message)


def require_array(name: str, x, ndim: int, layout: str) -> None:
  """`x` is an array of rank `ndim` (`layout` names its dimensions, e.g. "[M, K]")."""
  require(
      hasattr(x, "shape") and hasattr(x, "dtype"),
      f"{name} must be an array {layout}, got {type(x).__name__}")
  require(x.ndim == ndim, f"{name} must have shape {layout}, got shape {tuple(x.shape)}")
