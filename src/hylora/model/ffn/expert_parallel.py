"""Expert parallelism: the "ep_alltoall" dispatcher (docs/moe.md).

Inside one `jax.shard_map` over the whole `(fsdp, expert)` mesh, every device holds a
slice of the tokens and the experts of its `expert` rank (slots `[r*S, (r+1)*S)`); the
experts' inner dimension, sharded over `fsdp` by meshes/rules.py, is all-gathered once per
layer (its transpose, a reduce-scatter, sums the LoRA gradients). Per chunk of tokens:

  route (slots [n, k]) -> one stable sort of the n*k pairs by slot (= by destination rank,
  then local expert, then token) -> send rows (one gather) -> all-to-all -> local grouped
  SwiGLU over the rank's S experts -> all-to-all back -> one gather per pair -> weighted
  combine.

Capacity: each device sends at most C rows to each rank per chunk (`capacity(pairs, R,
moe.capacity_factor)`; factor <= 0 makes C = all pairs, i.e. dropless). Kept pairs are the
first C of that destination in sort order: a device drops the pairs of its chunk bound
for rank r whose position in the (local slot, token, choice) order exceeds C. A dropped
pair contributes zero (the token keeps its residual and any other experts); the count of
dropped pairs, summed over devices, is the `dropped_tokens` statistic.

Transports (moe.transport): "padded" moves [R, C, d] buffers with `all_to_all` (every
backend); "ragged" moves only the real rows with `ragged_all_to_all` into the same
layout (GPU/TPU: XLA:CPU lacks it). Chunks (moe.overlap_chunks) are independent
pipelines, so the scheduler can run one chunk's all-to-all while another computes.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from meshes import logical_axes as ax
from hylora.core.config import MoEConfig
from hylora.core.errors import ConfigError
from hylora.model.ffn.dispatch import dropless
from hylora.model.ffn.experts import expert_ffn
from hylora.model.ffn.permute_rows import gather_rows, permute_rows
from meshes.rules import PARAM_RULES, current_mesh, logical_to_spec

EXPERT_AXIS, FSDP_AXIS = "expert", "fsdp"
TOKEN_AXES = (FSDP_AXIS, EXPERT_AXIS)

# Logical axes of the weights RoutedExperts hands over (a shared A has no slot axis).
WEIGHT_AXES = {
    "gate_up": (ax.EXP, ax.EMBED, ax.EXP_MLP),
    "down": (ax.EXP, ax.EXP_MLP, ax.EMBED),
    "lora_a": (ax.EXP, ax.EMBED, ax.LORA_RANK),
    "lora_b": (ax.EXP, ax.LORA_RANK, ax.EXP_MLP),
}
SHARED_A_AXES = (ax.EMBED, ax.LORA_RANK)

# Platforms whose XLA implements ragged_all_to_all.
RAGGED_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")


def xla_options(moe: MoEConfig, platform: str) -> dict:
  """XLA options a program using this dispatcher should be compiled with.

  "ragged" asks XLA:GPU to decompose ragged_all_to_all into an all_to_all plus slices,
  far faster than its own ragged_all_to_all (docs/moe.md). "padded" needs nothing."""
  if moe.transport == "ragged" and platform in ("gpu", "cuda", "rocm"):
    return {"xla_gpu_unsupported_enable_ragged_all_to_all_decomposer": True}
  return {}


def ragged_collective(*args, **kwargs):
  """jax.lax.ragged_all_to_all (indirect so it can be swapped in tests on CPU)."""
  return jax.lax.ragged_all_to_all(*args, **kwargs)


def capacity(pairs: int, ranks: int, factor: float) -> int:
  """Rows one device may send to one EP rank per chunk of `pairs` token-expert pairs."""
  if factor <= 0:
    return pairs
  return max(1, min(pairs, math.ceil(factor * pairs / ranks)))


class SendPlan(NamedTuple):
  """Where each of a chunk's pairs goes (all arrays local to one device)."""
  order: jax.Array  # [P] pairs sorted by slot (stable)
  inverse: jax.Array  # [P] position of each pair in `order`
  start: jax.Array  # [R] first sorted position bound for each rank
  sent: jax.Array  # [R] rows sent to each rank (<= capacity)
  kept: jax.Array  # [R, S] rows kept per (rank, local slot)
  dropped: jax.Array  # [] pairs dropped


def plan_sends(slots: jax.Array, ranks: int, per_rank: int, cap: int) -> SendPlan:
  pairs = slots.shape[0]
  order = jnp.argsort(slots, stable=True).astype(jnp.int32)
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(pairs, dtype=jnp.int32))
  counts = jnp.bincount(slots, length=ranks * per_rank).astype(jnp.int32)
  counts = counts.reshape(ranks, per_rank)
  per_dest = counts.sum(1)
  start = jnp.cumsum(per_dest) - per_dest
  before = jnp.cumsum(counts, axis=1) - counts
  kept = jnp.clip(cap - before, 0, counts)
  sent = kept.sum(1)
  return SendPlan(order, inverse, start, sent, kept, jnp.sum(per_dest - sent))


# ---------------------------------------------------------------- transports
# Both deliver received rows as [R * C, d], block j from source rank j (valid rows first),
# and return the results in the same layout, block r answering what was sent to rank r.
# Every gather names its readers (gather_rows), so the backward gathers instead of
# scattering: a token is read by its k pairs' rows, a returned row by one pair.


class PairRows(NamedTuple):
  """The two directions between a chunk's pairs (original order, [P]) and the rows of
  the [R * C] send / return layout."""
  row_of_pair: jax.Array  # [P] row holding the pair (0 if dropped)
  pair_kept: jax.Array  # [P] the pair was sent
  pair_of_row: jax.Array  # [R * C] pair held by the row (a clipped one where none)
  row_valid: jax.Array  # [R * C] the row holds a pair


def pair_rows(slots: jax.Array, plan: SendPlan, cap: int, per_rank: int) -> PairRows:
  pairs = slots.shape[0]
  rank = slots[plan.order] // per_rank  # sorted order is by destination rank
  pos = jnp.arange(pairs, dtype=jnp.int32) - plan.start[rank]
  kept = pos < plan.sent[rank]
  row = jnp.where(kept, rank * cap + jnp.minimum(pos, cap - 1), 0)
  c = jnp.arange(cap, dtype=jnp.int32)
  sorted_pos = jnp.minimum(plan.start[:, None] + c[None, :], pairs - 1)
  return PairRows(row[plan.inverse], kept[plan.inverse], plan.order[sorted_pos].reshape(-1),
                  (c[None, :] < plan.sent[:, None]).reshape(-1))


def _padded_out(x, token_of_pair, rows: PairRows, cap, ranks):
  n = x.shape[0]
  k = rows.row_of_pair.shape[0] // n
  send = gather_rows(x, token_of_pair[rows.pair_of_row], rows.row_of_pair.reshape(n, k),
                     rows.pair_kept.reshape(n, k))  # the one gather in
  send = jnp.where(rows.row_valid[:, None], send, jnp.zeros((), x.dtype))
  recv = jax.lax.all_to_all(send.reshape(ranks, cap, -1), EXPERT_AXIS, 0, 0, tiled=True)
  return recv.reshape(ranks * cap, -1)


def _padded_back(y, plan, cap, ranks):
  back = jax.lax.all_to_all(y.reshape(ranks, cap, -1), EXPERT_AXIS, 0, 0, tiled=True)
  return back.reshape(ranks * cap, -1)


def _ragged_offsets(cap, ranks):
  me = jax.lax.axis_index(EXPERT_AXIS).astype(jnp.int32)
  return jnp.full((ranks,), me * cap, jnp.int32), jnp.arange(ranks, dtype=jnp.int32) * cap


def _ragged_out(x, token_of_pair, plan, cap, ranks, recv_sizes):
  n = x.shape[0]
  readers = plan.inverse.reshape(n, -1)  # token n's pairs, at their sorted positions
  rows = gather_rows(x, token_of_pair[plan.order], readers, jnp.ones(readers.shape, bool))
  mine, _ = _ragged_offsets(cap, ranks)
  out = jnp.zeros((ranks * cap, x.shape[1]), x.dtype)
  return ragged_collective(rows, out, plan.start, plan.sent, mine, recv_sizes,
                           axis_name=EXPERT_AXIS)


def _ragged_back(y, plan, cap, ranks, recv_sizes):
  mine, blocks = _ragged_offsets(cap, ranks)
  out = jnp.zeros_like(y)
  return ragged_collective(y, out, blocks, recv_sizes, mine, plan.sent, axis_name=EXPERT_AXIS)


# ---------------------------------------------------------------- one chunk


def _local_experts(recv, recv_kept, weights, options, dropout_key):
  """Rows [R*C, d] (block j from rank j, sorted by local slot) through the S local experts."""
  ranks, per_rank = recv_kept.shape
  cap = recv.shape[0] // ranks
  ends = jnp.cumsum(recv_kept, axis=1)  # [R, S]
  c = jnp.arange(cap, dtype=jnp.int32)
  row_slot = jnp.sum(c[None, :, None] >= ends[:, None, :], axis=-1).reshape(-1)  # S: empty
  order = jnp.argsort(row_slot, stable=True).astype(jnp.int32)
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
  y = expert_ffn(weights, permute_rows(recv, order, inverse), recv_kept.sum(0),
                 dropout_key=dropout_key, **options)
  return permute_rows(y, inverse, order)  # rows past the groups come out zero


def _chunk(x, weights_k, slots, expert_weights, options, dropout_key, *, ranks, per_rank, cap,
           transport):
  n, k = slots.shape
  plan = plan_sends(slots.reshape(-1), ranks, per_rank, cap)
  rows = pair_rows(slots.reshape(-1), plan, cap, per_rank)
  token_of_pair = jnp.arange(n * k, dtype=jnp.int32) // k
  recv_kept = jax.lax.all_to_all(plan.kept, EXPERT_AXIS, 0, 0, tiled=True)  # [R src, S]
  if transport == "ragged":
    recv_sizes = recv_kept.sum(1)
    recv = _ragged_out(x, token_of_pair, plan, cap, ranks, recv_sizes)
  else:
    recv = _padded_out(x, token_of_pair, rows, cap, ranks)
  y = _local_experts(recv, recv_kept, expert_weights, options, dropout_key)
  if transport == "ragged":
    back = _ragged_back(y, plan, cap, ranks, recv_sizes)
  else:
    back = _padded_back(y, plan, cap, ranks)
  # Each pair's result, from its row of `back`; a row is read by its one pair.
  y_pairs = gather_rows(back, rows.row_of_pair, rows.pair_of_row[:, None],
                        rows.row_valid[:, None])  # the one gather out
  y_pairs = jnp.where(rows.pair_kept[:, None], y_pairs, jnp.zeros((), y_pairs.dtype))
  y = jnp.einsum("nkd,nk->nd", y_pairs.reshape(n, k, -1).astype(jnp.float32), weights_k)
  return y.astype(x.dtype), plan.dropped


# ---------------------------------------------------------------- the dispatcher


def _weight_spec(name, array, mesh):
  shared = name == "lora_a" and array.ndim == 2
  spec = logical_to_spec(SHARED_A_AXES if shared else WEIGHT_AXES[name], array.shape, mesh,
                         PARAM_RULES)
  if not shared and spec[0] != EXPERT_AXIS:
    raise ConfigError(f"model.moe.experts: {array.shape[0]} expert slots cannot be split over "
                      f"the expert mesh axis of size {mesh.shape[EXPERT_AXIS]} (mesh.expert)")
  return spec


def _gather_inner(array, spec):
  """All-gather every dimension sharded over the mesh except the slot axis.

  The shards arrive on a new leading axis, then fold into their dimension: a gather
  along an inner dimension makes XLA:GPU lay the operand out with that dimension major,
  i.e. transpose the whole stacked weight of every scanned layer ahead of the loop."""
  for dim, entry in enumerate(spec):
    if entry is None or entry == EXPERT_AXIS:
      continue
    parts = jax.lax.all_gather(array, entry, axis=0, tiled=False)  # [shards, ...]
    parts = jnp.moveaxis(parts, 0, dim)  # [..., shards, local, ...]
    array = parts.reshape(*array.shape[:dim], -1, *array.shape[dim + 1:])
  return array


def check_transport(transport: str, mesh) -> None:
  platform = mesh.devices.flat[0].platform
  if transport == "ragged" and platform not in RAGGED_PLATFORMS:
    raise ConfigError(f"model.moe.transport: 'ragged' uses ragged_all_to_all, which XLA on "
                      f"{platform!r} does not implement; use 'padded' there")


def ep_alltoall(x: jax.Array, weights: jax.Array, experts: jax.Array, expert_weights: dict,
                options: dict, *, num_experts: int, dropout_key=None, moe: MoEConfig | None = None):
  """x [N, d], weights/experts [N, k] (experts: slots) -> (y [N, d], stats).

  Without an activation mesh (or on one device) this is the dropless reference."""
  moe = moe or MoEConfig()
  mesh = current_mesh()
  if mesh is None or mesh.size == 1:
    return dropless(x, weights, experts, expert_weights, options, num_experts=num_experts,
                    dropout_key=dropout_key)
  check_transport(moe.transport, mesh)
  ranks, devices = mesh.shape[EXPERT_AXIS], mesh.size
  if num_experts % ranks:
    raise ConfigError(f"model.moe.experts: {num_experts} expert slots cannot be split over "
                      f"the expert mesh axis of size {ranks} (mesh.expert)")
  n, k = experts.shape
  chunks = moe.overlap_chunks
  if n % (devices * chunks):
    raise ConfigError(f"model.moe.overlap_chunks: the {n} tokens of a MoE layer do not split "
                      f"into {devices} devices x {chunks} chunks")
  chunk_tokens = n // devices // chunks
  cap = capacity(chunk_tokens * k, ranks, moe.capacity_factor)
  per_rank = num_experts // ranks
  specs = {name: _weight_spec(name, w, mesh) for name, w in expert_weights.items()}
  tokens = P(TOKEN_AXES, None)

  def local(x, weights_k, slots, expert_weights, key):
    expert_weights = {name: _gather_inner(w, specs[name]) for name, w in expert_weights.items()}
    if key is not None:  # distinct LoRA-dropout masks per device
      key = jax.random.fold_in(key, jax.lax.axis_index(TOKEN_AXES))
    ys, dropped = [], []
    for i in range(chunks):
      rows = slice(i * chunk_tokens, (i + 1) * chunk_tokens)
      chunk_key = None if key is None else jax.random.fold_in(key, i)
      y, d = _chunk(x[rows], weights_k[rows], slots[rows], expert_weights, options, chunk_key,
                    ranks=ranks, per_rank=per_rank, cap=cap, transport=moe.transport)
      ys.append(y)
      dropped.append(d)
    total = jax.lax.psum(sum(dropped).astype(jnp.float32), TOKEN_AXES)
    return jnp.concatenate(ys, axis=0), total

  key_spec = None if dropout_key is None else P()
  y, dropped = jax.shard_map(local, mesh=mesh, in_specs=(tokens, tokens, tokens, specs, key_spec),
                             out_specs=(tokens, P()))(x, weights, experts, expert_weights,
                                                      dropout_key)
  return y, {"dropped_tokens": dropped}
