"""Shape validation and small layout helpers shared by the reference and the kernels."""
import jax.numpy as jnp

CHUNK = 64


def _shape_error(name, arr, expected):
  raise ValueError(f"{name} has shape {tuple(arr.shape)}, expected {expected}")


def validate(q, k, v, g, beta=None, initial_state=None, segment_ids=None, decay=None):
  """Checks the documented layouts (and a decay_gate.DecayGate's against g); returns
    (B, T, H, Dk, Dv)."""
  for name, arr in (("q", q), ("k", k), ("v", v), ("g", g)):
    if getattr(arr, "ndim", None) != 4:
      raise ValueError(f"{name} must be 4-D [B, T, H, D], got shape {getattr(arr, 'shape', None)}")
  B, T, H, Dk = q.shape
  if T < 1:
    raise ValueError(f"q has shape {tuple(q.shape)}: the sequence length T must be >= 1")
  if k.shape != q.shape:
    _shape_error("k", k, (B, T, H, Dk))
  if v.shape[:3] != (B, T, H):
    _shape_error("v", v, (B, T, H, "Dv"))
  Dv = v.shape[3]
  if g.shape != q.shape:
    _shape_error("g", g, (B, T, H, Dk))
  if beta is not None and beta.shape != (B, T, H):
    _shape_error("beta", beta, (B, T, H))
  if initial_state is not None and initial_state.shape != (B, H, Dk, Dv):
    _shape_error("initial_state", initial_state, (B, H, Dk, Dv))
  if segment_ids is not None:
    if segment_ids.shape != (B, T):
      _shape_error("segment_ids", segment_ids, (B, T))
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise ValueError(f"segment_ids must be an integer array, got dtype {segment_ids.dtype}")
  if decay is not None:
    decay.check(g)
  return B, T, H, Dk, Dv


def check_head_dims(Dk, Dv):
  """The Pallas kernels' head sizes: powers of two >= 16."""
  for name, d in (("Dk (q.shape[-1])", Dk), ("Dv (v.shape[-1])", Dv)):
    if d < 16 or d & (d - 1):
      raise ValueError(f"{name} = {d}: the Pallas kernels need a power of two >= 16")


def check_tile(name, size, dim_name, dim):
  """A kernel tile of `size` channels: a power of two >= 16 dividing the head size."""
  if size < 16 or size & (size - 1) or dim % size:
    raise ValueError(f"{name} = {size}: need a power of two >= 16 dividing "
                     f"{dim_name} = {dim}")
  return size


def default_scale(scale, dk):
  return dk**-0.5 if scale is None else scale


def run_ids(segment_ids, B, T):
  """Monotone run index per token: +1 wherever segment_ids changes from the previous token.

    Comparing run indices (not raw ids) keeps a repeated id after a different one a new segment.
    """
  if segment_ids is None:
    return jnp.zeros((B, T), jnp.int32)
  change = (segment_ids[:, 1:] != segment_ids[:, :-1]).astype(jnp.int32)
  return jnp.concatenate([jnp.zeros((B, 1), jnp.int32), jnp.cumsum(change, axis=1)], axis=1)


def inverse_l2_norms(x, eps=1e-6):
  """1 / sqrt(sum(x^2) + eps) over the last axis (dropped), fp32: the one definition of the
    norm that l2_normalize and the KDA scores kernel (which scales its scores by it) share."""
  x = x.astype(jnp.float32)
  return inverse_root(jnp.sum(x * x, axis=-1), eps)


def inverse_root(sum_of_squares, eps=1e-6):
  """inverse_l2_norms from the sums of squares (a kernel summing them a block at a time)."""
  return jnp.reciprocal(jnp.sqrt(sum_of_squares + eps))


def inverse_l2_norm(x, eps=1e-6):
  """inverse_l2_norms with the last axis kept (size 1)."""
  return inverse_l2_norms(x, eps)[..., None]


def l2_normalize(x, eps=1e-6):
  return x.astype(jnp.float32) * inverse_l2_norm(x, eps)


def pad_time(x, t_pad, mode="zero"):
  """Pads axis 1 to t_pad: zeros (no contribution, no decay) or repeats the edge (run ids)."""
  extra = t_pad - x.shape[1]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[1] = (0, extra)
  return jnp.pad(x, widths, mode="edge" if mode == "edge" else "constant")
