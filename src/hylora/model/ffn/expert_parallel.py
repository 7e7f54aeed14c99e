"""Expert parallelism: the "ep_alltoall" dispatcher (docs/moe.md).

Inside one `jax.shard_map` over the whole `(fsdp, expert)` mesh, every device holds a
slice of the tokens and the experts of its `expert` rank (slots `[r*S, (r+1)*S)`); the
experts' inner dimension, sharded over `fsdp` by meshes/rules.py, is all-gathered once per
layer (its transpose, a reduce-scatter, sums the LoRA gradients). Per chunk of tokens:

  route (slots [n, k]) -> one stable sort of the n*k pairs by slot (= by destination rank,
  then local expert, then token) -> all-to-all of the pair counts per (rank, local slot)
  -> send rows (one gather) -> all-to-all -> local grouped SwiGLU over the rank's S
  experts -> all-to-all back -> one gather per pair -> weighted combine.

Rounds (the default, moe.capacity_factor <= 0: dropless): each device sends at most C
rows to each rank per all-to-all round, C = `capacity(pairs, R, moe.round_capacity)` for
a chunk's pairs. The first round is the pipeline above, carrying the first C pairs of
each destination in sort order; the pairs beyond C move in further rounds of C rows
(overflow_rounds.py), as many as the busiest (device, destination) of the mesh needs:
none when the routing is balanced within `round_capacity`. Buffers hold R*C rows
whatever the routing, nothing is dropped; the rounds taken are the `all_to_all_rounds`
statistic.

Capacity (moe.capacity_factor > 0, explicit): one round with C = `capacity(pairs, R,
moe.capacity_factor)`; a device drops the pairs of its chunk bound for rank r whose
position in the (local slot, token, choice) order exceeds C. A dropped pair contributes
zero (the token keeps its residual and any other experts); the count of dropped pairs,
summed over devices, is the `dropped_tokens` statistic.

Transports of the first round (moe.transport): "padded" moves [R, C, d] buffers with
`all_to_all` (every backend); "ragged" moves only the real rows with `ragged_all_to_all`
into the same layout (GPU/TPU: XLA:CPU lacks it). Later rounds are padded. Chunks
(moe.overlap_chunks) are independent pipelines, so the scheduler can run one chunk's
all-to-all while another computes.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from meshes import logical_axes as ax
from hylora.core.config import MoEConfig
from hylora.core.errors import ConfigError
from hylora.model.ffn.dispatch import dropless
from hylora.model.ffn.local_experts import local_experts, window_counts
from hylora.model.ffn.overflow_rounds import RoundPlan, overflow_rounds, rounds_after_first
from hylora.model.ffn.permute_rows import gather_rows
from hylora.quant.packed_weight import PackedWeight, packed_axes
from meshes.rules import (ACTIVATION_RULES, PARAM_RULES, current_mesh, follow_spec, logical_to_spec)

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
  """Rows one device may send to one EP rank per chunk of `pairs` token-expert pairs
  (factor <= 0: all of them, the worst case)."""
  if factor <= 0:
    return pairs
  return max(1, min(pairs, math.ceil(factor * pairs / ranks)))


def round_rows(pairs: int, ranks: int, moe: MoEConfig) -> int:
  """C: the rows one device sends one EP rank per all-to-all round of a chunk of `pairs`
  pairs; the capacity itself when `capacity_factor > 0` (one round, the rest dropped)."""
  if moe.capacity_factor > 0:
    return capacity(pairs, ranks, moe.capacity_factor)
  if moe.round_capacity <= 0:
    raise ConfigError(f"model.moe.round_capacity: must be > 0 (rows per round as a multiple of "
                      f"the mean per rank), got {moe.round_capacity}")
  return capacity(pairs, ranks, moe.round_capacity)


def later_round_rows(pairs: int, ranks: int, moe: MoEConfig) -> int:
  """C': the rows per destination of each round after the first (dropless only; 0 when
  `capacity_factor > 0`: there are no later rounds)."""
  if moe.capacity_factor > 0:
    return 0
  if moe.overflow_round_capacity <= 0:
    raise ConfigError(f"model.moe.overflow_round_capacity: must be > 0, got "
                      f"{moe.overflow_round_capacity}")
  return min(round_rows(pairs, ranks, moe), capacity(pairs, ranks, moe.overflow_round_capacity))


def round_buffer_bytes(moe: MoEConfig, width: int, tokens_per_device: int, ranks: int,
                       itemsize: int = 2) -> int:
  """Bytes one device's all-to-all round buffers hold, for one chunk: the first round's
  and a later round's (both are parts of one layer's program).

  moe: the MoE config (top_k, expert_ffn, overlap_chunks, capacity_factor,
  round_capacity, overflow_round_capacity); width: the width of the rows the experts see
  (d_model, or the latent MoE's latent_dim); tokens_per_device: the tokens of one MoE
  layer call on one device (a micro-batch's tokens / devices); ranks: the expert-parallel
  ranks (mesh.expert); itemsize: bytes per activation element.

  Per row of a round: its backward, the larger, holds rows and their cotangents out
  ([R, C, 2 width], sent and received), the rows' gradients back ([R, C, width], sent and
  received) and the recomputed experts' intermediates ([R*C, 3 expert_ffn]: gate_up's
  output and the activation). A forward round holds 4 width + 3 expert_ffn per row."""
  chunks = moe.overlap_chunks
  if tokens_per_device % chunks:
    raise ConfigError(f"model.moe.overlap_chunks: {tokens_per_device} tokens per device do not "
                      f"split into {chunks} chunks")
  pairs = tokens_per_device // chunks * moe.top_k
  rows = ranks * (round_rows(pairs, ranks, moe) + later_round_rows(pairs, ranks, moe))
  return rows * (6 * width + 3 * moe.expert_ffn) * itemsize


class SendPlan(NamedTuple):
  """Where each of a chunk's pairs goes (all arrays local to one device)."""
  order: jax.Array  # [P] pairs sorted by slot (stable)
  inverse: jax.Array  # [P] position of each pair in `order`
  start: jax.Array  # [R] first sorted position bound for each rank
  sent: jax.Array  # [R] rows sent to each rank in the first round (<= capacity)
  counts: jax.Array  # [R, S] pairs per (rank, local slot)
  kept: jax.Array  # [R, S] of them in the first round
  dropped: jax.Array  # [] pairs past the first round


def plan_sends(slots: jax.Array, ranks: int, per_rank: int, cap: int) -> SendPlan:
  pairs = slots.shape[0]
  order = jnp.argsort(slots, stable=True).astype(jnp.int32)
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(pairs, dtype=jnp.int32))
  counts = jnp.bincount(slots, length=ranks * per_rank).astype(jnp.int32)
  counts = counts.reshape(ranks, per_rank)
  per_dest = counts.sum(1)
  start = jnp.cumsum(per_dest) - per_dest
  kept = window_counts(counts, 0, cap)
  sent = kept.sum(1)
  return SendPlan(order, inverse, start, sent, counts, kept, jnp.sum(per_dest - sent))


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


def _chunk(x, weights_k, slots, expert_weights, options, dropout_key, *, ranks, per_rank, cap,
           transport, later_cap):
  """-> (y [n, d], pairs dropped, all-to-all rounds)."""
  n, k = slots.shape
  plan = plan_sends(slots.reshape(-1), ranks, per_rank, cap)
  rows = pair_rows(slots.reshape(-1), plan, cap, per_rank)
  token_of_pair = jnp.arange(n * k, dtype=jnp.int32) // k
  recv_counts = jax.lax.all_to_all(plan.counts, EXPERT_AXIS, 0, 0, tiled=True)  # [R src, S]
  recv_kept = window_counts(recv_counts, 0, cap)
  if transport == "ragged":
    recv_sizes = recv_kept.sum(1)
    recv = _ragged_out(x, token_of_pair, plan, cap, ranks, recv_sizes)
  else:
    recv = _padded_out(x, token_of_pair, rows, cap, ranks)
  y = local_experts(recv, recv_kept, expert_weights, options, dropout_key)
  if transport == "ragged":
    back = _ragged_back(y, plan, cap, ranks, recv_sizes)
  else:
    back = _padded_back(y, plan, cap, ranks)
  # Each pair's result, from its row of `back`; a row is read by its one pair.
  y_pairs = gather_rows(back, rows.row_of_pair, rows.pair_of_row[:, None],
                        rows.row_valid[:, None])  # the one gather out
  y_pairs = jnp.where(rows.pair_kept[:, None], y_pairs, jnp.zeros((), y_pairs.dtype))
  rounds, dropped = jnp.ones((), jnp.int32), plan.dropped
  if later_cap:  # dropless: the pairs past the first C of their destination, in more rounds
    per_dest = plan.counts.sum(1)
    trips = jax.lax.pmax(rounds_after_first(per_dest, cap, later_cap), TOKEN_AXES)
    later = RoundPlan(plan.order, plan.start, per_dest, recv_counts, trips, rows.pair_kept)
    y_pairs = overflow_rounds(y_pairs, x, expert_weights, dropout_key, later, options=options,
                              first=cap, cap=later_cap, axis_name=EXPERT_AXIS)
    rounds, dropped = trips + 1, jnp.zeros_like(dropped)
  # The weighted combine stays outside the rounds: autodiff gives the routing weights'
  # gradient.
  y = jnp.einsum("nkd,nk->nd", y_pairs.reshape(n, k, -1).astype(jnp.float32), weights_k)
  return y.astype(x.dtype), dropped, rounds


# ---------------------------------------------------------------- the dispatcher


def _weight_spec(name, array, mesh):
  """The spec of one expert weight as the parameter rules shard it (a packed weight: one
  per array, as meshes.rules.state_shardings gives them)."""
  if isinstance(array, PackedWeight):
    axes = packed_axes(WEIGHT_AXES[name], 1, 1)
    spec = logical_to_spec(axes, array.codes.shape, mesh, PARAM_RULES)
    if spec[0] != EXPERT_AXIS:
      raise ConfigError(f"model.moe.experts: {array.codes.shape[0]} expert slots cannot be "
                        f"split over the expert mesh axis of size {mesh.shape[EXPERT_AXIS]} "
                        "(mesh.expert)")
    return jax.tree.map(lambda a: follow_spec(spec, a.shape, mesh), array)
  shared = name == "lora_a" and array.ndim == 2
  spec = logical_to_spec(SHARED_A_AXES if shared else WEIGHT_AXES[name], array.shape, mesh,
                         PARAM_RULES)
  if not shared and spec[0] != EXPERT_AXIS:
    raise ConfigError(f"model.moe.experts: {array.shape[0]} expert slots cannot be split over "
                      f"the expert mesh axis of size {mesh.shape[EXPERT_AXIS]} (mesh.expert)")
  return spec


def _gather_inner(array, spec):
  if isinstance(array, PackedWeight):
    return jax.tree.map(_gather_array, array, spec)
  return _gather_array(array, spec)


def _gather_array(array, spec):
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
  """x [N, d], weights/experts [N, k] (experts: slots) -> (y [N, d], stats); or the same
  with [B, T] for [N], each device then taking the rows and the range of the sequence the
  activation rules give it (a [B, T] split over batch and sequence has no contiguous
  flat layout to reshape into: XLA would move every token to flatten it).

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
  k = experts.shape[-1]
  n = math.prod(experts.shape[:-1])
  chunks = moe.overlap_chunks
  if n % (devices * chunks):
    raise ConfigError(f"model.moe.overlap_chunks: the {n} tokens of a MoE layer do not split "
                      f"into {devices} devices x {chunks} chunks")
  chunk_tokens = n // devices // chunks
  cap = round_rows(chunk_tokens * k, ranks, moe)
  later_cap = later_round_rows(chunk_tokens * k, ranks, moe)
  per_rank = num_experts // ranks
  specs = {name: _weight_spec(name, w, mesh) for name, w in expert_weights.items()}
  if x.ndim == 3:
    tokens = P(*logical_to_spec((ax.BATCH, ax.SEQ), x.shape[:2], mesh, ACTIVATION_RULES), None)
  else:
    tokens = P(TOKEN_AXES, None)
  local_shape = None

  def local(x, weights_k, slots, expert_weights, key):
    nonlocal local_shape
    if x.ndim == 3:  # this device's [rows, range of the sequence] as one list of tokens
      local_shape = x.shape[:2]
      x, weights_k, slots = (a.reshape(-1, a.shape[-1]) for a in (x, weights_k, slots))
    expert_weights = {name: _gather_inner(w, specs[name]) for name, w in expert_weights.items()}
    if key is not None:  # distinct LoRA-dropout masks per device
      key = jax.random.fold_in(key, jax.lax.axis_index(TOKEN_AXES))
    ys, dropped, rounds = [], [], []
    for i in range(chunks):
      rows = slice(i * chunk_tokens, (i + 1) * chunk_tokens)
      chunk_key = None if key is None else jax.random.fold_in(key, i)
      y, d, r = _chunk(x[rows], weights_k[rows], slots[rows], expert_weights, options, chunk_key,
                       ranks=ranks, per_rank=per_rank, cap=cap, transport=moe.transport,
                       later_cap=later_cap)
      ys.append(y)
      dropped.append(d)
      rounds.append(r)
    total = jax.lax.psum(sum(dropped).astype(jnp.float32), TOKEN_AXES)
    y = jnp.concatenate(ys, axis=0)
    if local_shape is not None:
      y = y.reshape(*local_shape, y.shape[-1])
    # Every chunk's count is already the mesh's maximum (in rounds) or 1.
    return y, total, functools.reduce(jnp.maximum, rounds)

  key_spec = None if dropout_key is None else P()
  y, dropped, rounds = jax.shard_map(local, mesh=mesh,
                                     in_specs=(tokens, tokens, tokens, specs, key_spec),
                                     out_specs=(tokens, P(), P()))(x, weights, experts,
                                                                   expert_weights, dropout_key)
  return y, {"dropped_tokens": dropped, "all_to_all_rounds": rounds.astype(jnp.float32)}
