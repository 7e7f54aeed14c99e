"""Logical axis names -> mesh axes.

Each logical axis lists candidate mesh-axis groups in order of preference. A dimension
takes the first candidate whose mesh axes are still unused by the array's other
dimensions and whose size divides the dimension; otherwise it stays replicated.
Dimensions choose left to right, those in CHOOSE_LAST after the others. So an
expert weight `[exp, embed, exp_mlp]` gets `exp -> expert`, `embed -> fsdp` (expert is
taken), and any other large weight gets its first shardable dimension split over both
axes (FSDP over every device).
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from meshes import logical_axes as ax

_BOTH = ("fsdp", "expert")
_FSDP_FIRST = (_BOTH, ("fsdp",), ("expert",))
_EXPERT_FIRST = (("expert",), ("fsdp",))

PARAM_RULES: dict[str, tuple[tuple[str, ...], ...]] = {
    ax.EXP: (("expert",),),
    ax.VOCAB:
        _FSDP_FIRST,
    ax.EMBED:
        _FSDP_FIRST,
    ax.MLP:
        _FSDP_FIRST,
    ax.EXP_MLP: (("fsdp",),),
    ax.HEADS:
        _FSDP_FIRST,
    ax.LOW_RANK:
        _FSDP_FIRST,
    # 64 heads (or 8 KV heads) cannot take 128 shards: a LoRA B factor [r, heads, head_dim]
    # splits heads over `fsdp` and head_dim over `expert`. A weight whose model width
    # already holds both axes leaves these unsplit.
    ax.KV_HEADS:
        _FSDP_FIRST,
    ax.HEAD_DIM:
        _EXPERT_FIRST,
}

# Dimensions that choose last, from what the array's other dimensions left: the output
# projection [heads, head_dim, embed] keeps embed over `expert` (contiguous rows of the
# checkpoint's [embed, heads * head_dim]), and head_dim takes nothing.
CHOOSE_LAST = (ax.HEAD_DIM,)

# Activations: the batch over every device when it divides; otherwise over the larger
# `expert` axis, and the sequence then takes `fsdp` (the target's 64 sequences on 2 x 64
# devices: one sequence per expert group, split in two along its length). Whatever the
# batch leaves, the sequence takes (context parallelism): one 1M-token sequence spreads
# over all 128 devices, 4 sequences over 2 x 64 take fsdp for the batch and expert for
# the sequence.
_BATCH_FIRST = (_BOTH, ("expert",), ("fsdp",))

ACTIVATION_RULES: dict[str, tuple[tuple[str, ...], ...]] = {
    ax.BATCH: _BATCH_FIRST,
    ax.TOKENS: _BATCH_FIRST,
    ax.SEQ: (_BOTH, ("fsdp",), ("expert",)),
    ax.EXP: (("expert",),),
}


def logical_to_spec(names, shape, mesh: jax.sharding.Mesh, rules) -> P:
  if names is None:
    return P()
  if len(names) != len(shape):
    raise ValueError(f"logical axes {names} do not match shape {shape}")
  used: set[str] = set()
  spec: list = [None] * len(names)
  order = sorted(range(len(names)), key=lambda i: names[i] in CHOOSE_LAST)  # stable
  for i in order:
    choice = None
    for group in rules.get(names[i], ()):
      if any(a in used or a not in mesh.shape for a in group):
        continue
      if shape[i] % math.prod(mesh.shape[a] for a in group) == 0:
        choice = group
        break
    if choice is not None:
      used.update(choice)
      spec[i] = choice[0] if len(choice) == 1 else choice
  return P(*spec)


def _axes_of(variable):
  return variable.get_metadata().get("out_sharding")


def follow_spec(spec: P, shape, mesh: jax.sharding.Mesh) -> P:
  """`spec` on an array of `shape`, each dimension replicated where its axes do not
  divide it."""

  def size(entry):
    return math.prod(mesh.shape[a] for a in ((entry,) if isinstance(entry, str) else entry))

  return P(*(e if e is None or n % size(e) == 0 else None for e, n in zip(spec, shape)))


def state_shardings(state, mesh: jax.sharding.Mesh, rules=None, min_shard_size: int = 0):
  """NamedSharding for every variable of an nnx.State (abstract or concrete).

  Variables with fewer than `min_shard_size` elements stay replicated: gathering them
  costs a collective's latency for almost no memory."""
  from flax import nnx

  rules = PARAM_RULES if rules is None else rules

  def one(v):
    names = _axes_of(v) if math.prod(v.shape) >= min_shard_size else None
    value = v.get_value()
    if hasattr(value, "shape") and hasattr(value, "dtype"):
      return v.replace(NamedSharding(mesh, logical_to_spec(names, v.shape, mesh, rules)))
    # A value made of several arrays of the same rank (a packed weight: codes, then their
    # scales) shards each like the first, along the dimensions it divides.
    arrays = jax.tree.leaves(value)
    spec = logical_to_spec(names, arrays[0].shape, mesh, rules)
    return v.replace(
        jax.tree.map(lambda a: NamedSharding(mesh, follow_spec(spec, a.shape, mesh)), value))

  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


_ACTIVE_MESH: contextvars.ContextVar = contextvars.ContextVar("activation_mesh", default=None)


@contextlib.contextmanager
def activation_mesh(mesh: jax.sharding.Mesh | None):
  """Within this context, `constrain` pins activations to `mesh` by ACTIVATION_RULES."""
  token = _ACTIVE_MESH.set(mesh)
  try:
    yield
  finally:
    _ACTIVE_MESH.reset(token)


def current_mesh() -> jax.sharding.Mesh | None:
  """The mesh of the enclosing `activation_mesh` context (None outside one)."""
  return _ACTIVE_MESH.get()


def constrain(x: jax.Array, names) -> jax.Array:
  mesh = _ACTIVE_MESH.get()
  if mesh is None or mesh.size == 1:
    return x
  spec = logical_to_spec(names, x.shape, mesh, ACTIVATION_RULES)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
