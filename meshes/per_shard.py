"""Run a kernel on each device's batch rows: `shard_map` over the mesh's batch axes.

A Pallas kernel is one custom call to XLA, and XLA's SPMD partitioner cannot split a
custom call: given batch-sharded operands it gathers them and runs the whole global
batch on every device. Attention kernels act on each sequence independently, so under
an active mesh (`meshes.rules.activation_mesh`) `split_over_batch(fn)` runs `fn` inside
`shard_map`, every array argument and result split along its leading (batch) dimension
over the axes the activation rules give the batch; an argument that says
`whole_on_every_device` (a kernel's small parameters, whose leading size may equal the
batch's by chance) goes to every device whole.

Where the rules also split the sequence (fewer sequences than devices), a sequence's
tokens live on several devices and a per-row kernel cannot run on one shard; the call
is left to XLA (correct, and replicated) and a warning says so once. The attention
kernels split such sequences themselves (state passing for linear recurrences,
`meshes.split_recurrence`; gathered keys for sparse attention and its indexer,
`meshes.gathered_keys`).

XLA:CPU partitions its own top-K (a `TopK` custom call) the same way: `split_over_tokens`
runs a function of each token alone (the MoE router's expert selection) on every
device's tokens, whether the rules split the batch, the sequence or both.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
from jax.sharding import PartitionSpec as P

from meshes.rules import ACTIVATION_RULES, current_mesh, logical_to_spec

_warned: set[str] = set()


def _is_row_array(x, batch: int) -> bool:
  return isinstance(x, jax.Array) and x.ndim >= 1 and x.shape[0] == batch


def _whole(x) -> bool:
  """An argument handed whole to every device (see the module doc)."""
  return getattr(x, "whole_on_every_device", False) is True


def _activation_spec(first):
  """(mesh, spec of ("batch", "seq")) for [B, T, ...] activations under the active mesh;
  None where no shard_map is needed (no mesh, one device, already inside one)."""
  mesh = current_mesh()
  inside_shard_map = bool(jax.sharding.get_abstract_mesh().manual_axes)
  if (mesh is None or mesh.size == 1 or inside_shard_map or not isinstance(first, jax.Array) or
      first.ndim < 2):
    return None
  batch, seq = first.shape[:2]
  return mesh, logical_to_spec(("batch", "seq"), (batch, seq), mesh, ACTIVATION_RULES)


def sequence_axes(entry) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry, as a tuple."""
  return (entry,) if isinstance(entry, str) else tuple(entry)


def sequence_split(x):
  """(mesh, batch axes, sequence axes) when the activation rules split the sequence of
  x [B, T, ...] over devices; None otherwise."""
  found = _activation_spec(x)
  if found is None or found[1][1] is None:
    return None
  mesh, spec = found
  return mesh, spec[0], spec[1]


def _warn_gathered(fn, batch: int, mesh):
  """Once per kernel: the sequence is split, so XLA runs the kernel on gathered operands."""
  name = getattr(fn, "__name__", repr(fn))
  if name not in _warned:
    _warned.add(name)
    warnings.warn(
        f"{name}: the activation rules split the sequence ({batch} sequences "
        f"on {mesh.size} devices), so XLA runs this kernel on gathered "
        f"operands", stacklevel=3)


def split_over_batch(fn):
  """fn(*arrays [B, T, ...], **kwargs) applied per device to its batch rows (see module doc).
  Arguments that are not [B, ...] arrays (scales, sizes, None) pass through unchanged."""

  @functools.wraps(fn)
  def per_shard(*args, **kwargs):
    first = next(
        (x for x in jax.tree.leaves((args, kwargs), is_leaf=_whole) if isinstance(x, jax.Array)),
        None)
    found = _activation_spec(first)
    if found is None:
      return fn(*args, **kwargs)
    mesh, spec = found
    batch, seq = first.shape[:2]
    if spec[0] is None or spec[1] is not None:
      _warn_gathered(fn, batch, mesh)
      return fn(*args, **kwargs)
    rows = P(spec[0])
    leaves, tree = jax.tree.flatten((args, kwargs), is_leaf=_whole)
    split = [i for i, x in enumerate(leaves) if _is_row_array(x, batch)]

    def body(*shards):
      local = list(leaves)
      for i, shard in zip(split, shards):
        local[i] = shard
      a, kw = jax.tree.unflatten(tree, local)
      return fn(*a, **kw)

    # check_vma off: kernel outputs carry no varying-axes type for the checker to compare
    return jax.shard_map(body, mesh=mesh, in_specs=tuple(rows for _ in split), out_specs=rows,
                         check_vma=False)(*(leaves[i] for i in split))

  return per_shard


def split_rows_whole_weight(fn):
  """fn(x [B, T, ...], weight, segment_ids [B, T] | None, **options) applied per device to
  its batch rows of x and segment_ids, the weight whole on every device (a weight whose
  first dimension happens to equal the batch is not split, as split_over_batch would).
  Where the rules split the sequence too, XLA runs it on gathered operands, as there."""

  @functools.wraps(fn)
  def per_shard(x, weight, segment_ids=None, **options):
    found = _activation_spec(x)
    if found is None:
      return fn(x, weight, segment_ids, **options)
    mesh, spec = found
    if spec[0] is None or spec[1] is not None:
      _warn_gathered(fn, x.shape[0], mesh)
      return fn(x, weight, segment_ids, **options)
    rows = P(spec[0])
    arrays = (x, weight) + (() if segment_ids is None else (segment_ids,))
    body = lambda x, w, *seg: fn(x, w, *(seg or (None,)), **options)
    # check_vma off: a custom call's outputs carry no varying-axes type to compare
    return jax.shard_map(body, mesh=mesh, in_specs=(rows, P(), rows)[:len(arrays)], out_specs=rows,
                         check_vma=False)(*arrays)

  return per_shard


def split_tokens_whole_weights(fn):
  """fn(x [B, T, ...] or [N, ...], *weights, **options) applied per device to its tokens
  of x; every other array (a weight) arrives whole on each device (XLA gathers a sharded
  one first), so fn must treat each token alone. Returns x's layout."""

  @functools.wraps(fn)
  def per_shard(x, *weights, **options):
    body = lambda x, *weights: fn(x, *weights, **options)
    found = _activation_spec(x)
    if found is None:
      return body(x, *weights)
    mesh, spec = found
    if x.ndim == 2:  # rows of tokens, not [B, T]
      spec = logical_to_spec(("tokens",), x.shape[:1], mesh, ACTIVATION_RULES)
    tokens = P(*spec)
    # check_vma off: a custom call's outputs carry no varying-axes type to compare
    return jax.shard_map(body, mesh=mesh, in_specs=(tokens, *(P() for _ in weights)),
                         out_specs=tokens, check_vma=False)(x, *weights)

  return per_shard


def split_over_tokens(fn):
  """fn(*arrays [B, T, ...]) applied per device to its tokens: every array argument is
  split along its batch and sequence dimensions as the activation rules split them, so
  fn must treat each token alone. Returns arrays of the same [B, T, ...] layout."""

  @functools.wraps(fn)
  def per_shard(*arrays):
    found = _activation_spec(arrays[0])
    if found is None:
      return fn(*arrays)
    mesh, spec = found
    tokens = P(spec[0], spec[1])
    # check_vma off: a custom call's outputs carry no varying-axes type to compare
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(tokens for _ in arrays), out_specs=tokens,
                         check_vma=False)(*arrays)

  return per_shard


def tokens_in_device_order(x):
  """x [B, T, ...] as [B * T, ...] with every device's tokens contiguous, for a sum over
  tokens (a permutation of the row-major flattening). A plain reshape is contiguous per
  device unless the rules split the batch over some axes with several rows a device and
  the sequence over others (4 rows of 262144 on 2 x 64: 2 rows x 4096 tokens a device);
  there XLA would gather whole rows to flatten them, so the device blocks are brought
  to the front first: [nb, B/nb, ns, T/ns] -> [nb, ns, B/nb, T/ns]."""
  found = _activation_spec(x)
  b, t = x.shape[:2]
  rest = x.shape[2:]
  if found is None:
    return x.reshape(b * t, *rest)
  mesh, spec = found
  size = lambda entry: math.prod(mesh.shape[a] for a in sequence_axes(entry)) if entry else 1
  nb, ns = size(spec[0]), size(spec[1])
  if nb == 1 or ns == 1 or b == nb:
    return x.reshape(b * t, *rest)
  blocks = x.reshape(nb, b // nb, ns, t // ns, *rest).swapaxes(1, 2)
  return blocks.reshape(b * t, *rest)
