"""The sequential chunk walk shared by the Mosaic GPU state kernels (GLA, KDA).

One warpgroup per (batch row, head, [BK, BV] state tile) carries the fp32 tile in
registers and visits the chunks in order (or in reverse). Each input is copied chunk by
chunk through TMA into one of `stages` shared-memory slots, up to stages - 1 chunks
ahead of the one being processed; `step` does a chunk's work from its slots and returns
the next tile. Input kinds (what one chunk's slot holds):
  "keys"        its C rows, the tile's key columns        ([B, Tp, H, Dk] arrays)
  "values"      its C rows, the tile's value columns      ([B, Tp, H, Dv])
  "chunk_keys"  the chunk's one row, the tile's key columns ([B, NT, H, Dk], fp32)
  "flags"       its C per-token values                     ([B, Tp], int32)
The fused forwards (_gla_forward_mosaic, _kda_forward_mosaic) run such a walk on one
warpgroup beside a second one that computes each chunk's outputs: walk_and_outputs.
"""
from typing import NamedTuple

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.linear_attention._inputs import CHUNK as C
from pallas_kernels.linear_attention._mosaic_common import F32, kernel, load, smem


def publish(value, buf, dst):
  """value -> shared memory (buf's dtype) -> dst through TMA."""
  buf[...] = value.astype(buf.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(buf, dst)


def prefetch(fetch, stages, n_chunks):
  """fetch(i, slot) for the first stages - 1 chunks, before the loop over chunks."""
  for i in range(min(stages - 1, n_chunks)):
    fetch(i, i)


def next_slot(fetch, i, stages, n_chunks, barriers):
  """The slot of chunk i, once its loads (on `barriers`) have arrived; first starts the
    loads of chunk i + stages - 1 into the slot chunk i - 1 has freed."""
  plgpu.commit_smem()  # this warpgroup is done reading the slot refilled next

  @pl.when(i + stages - 1 < n_chunks)
  def _():
    fetch(i + stages - 1, lax.rem(i + stages - 1, stages))

  slot = lax.rem(i, stages)
  plgpu.barrier_wait(barriers.at[slot])
  return slot


def publish_or_share(value, buf, dst):
  """value -> buf (shared memory, for the other warpgroup), and on through TMA to dst
    unless dst is None."""
  if dst is not None:
    publish(value, buf, dst)
  else:
    buf[...] = value.astype(buf.dtype)
    plgpu.commit_smem()


class StateSide(NamedTuple):
  """Warpgroup 0 of `walk_and_outputs`: fetch(i, slot) starts chunk i's TMA loads;
    share(i, slot, S) publishes what the outputs need of the state S entering chunk i;
    update(i, slot, S) -> the state after it; init() -> the first state; finish(S)
    stores the last."""
  fetch: object
  share: object
  update: object
  init: object
  finish: object


class OutputSide(NamedTuple):
  """Warpgroup 1 of `walk_and_outputs`: fetch(i, slot); read(i, slot) -> what it computes
    from what is shared (no other step may read it); write(i, slot, value) the rest,
    output included."""
  fetch: object
  read: object
  write: object


def walk_and_outputs(n_chunks, stages, slot_barriers, ready, free, done, state, outputs):
  """The chunk loops of a kernel of two warpgroups: warpgroup 0 walks the state (`state`,
    a StateSide), sharing what chunk i needs with warpgroup 1 (`outputs`, an OutputSide),
    which computes chunk i's outputs while warpgroup 0 moves on. Each warpgroup keeps its
    own TMA slots (slot_barriers: one barrier array each). Barriers: `ready` (chunk i's
    share is published) and `free` (warpgroup 1 has read it: warpgroup 0 may overwrite
    it); `done`: neither leaves while the other still issues warpgroup matmuls."""

  @pl.when(lax.axis_index("wg") == 0)
  def _state():
    prefetch(state.fetch, stages, n_chunks)

    def step(i, S):
      slot = next_slot(state.fetch, i, stages, n_chunks, slot_barriers[0])

      @pl.when(i >= 1)
      def _():
        plgpu.barrier_wait(free)

      # what went to memory from the shared buffers last chunk has left them too
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      state.share(i, slot, S)
      plgpu.barrier_arrive(ready)
      return state.update(i, slot, S)

    state.finish(lax.fori_loop(0, n_chunks, step, state.init()))
    plgpu.barrier_wait(free)  # warpgroup 1's last arrival
    plgpu.wait_smem_to_gmem(0)

  @pl.when(lax.axis_index("wg") == 1)
  def _outputs():
    prefetch(outputs.fetch, stages, n_chunks)

    def step(i, carry):
      slot = next_slot(outputs.fetch, i, stages, n_chunks, slot_barriers[1])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last output is out
      plgpu.barrier_wait(ready)
      value = outputs.read(i, slot)
      plgpu.barrier_arrive(free)
      outputs.write(i, slot, value)
      return carry

    lax.fori_loop(0, n_chunks, step, None)
    plgpu.wait_smem_to_gmem(0)

  plgpu.barrier_arrive(done)
  plgpu.barrier_wait(done)


def _slot_buffer(kind, arr, stages, bk, bv):
  if kind == "chunk_keys":
    return plgpu.SMEM((stages, bk), F32)
  if kind == "flags":
    return plgpu.SMEM((stages, C), arr.dtype)
  width = bk if kind == "keys" else bv
  # warpgroup-matmul operands share the swizzle of a value-tile row
  return smem((stages, C, width), arr.dtype, swizzle_row=bv)


def chunk_walk(inputs, h0, out_types, step, *, block_k, block_v, stages, reverse, scratch, name,
               interpret):
  """inputs: [(kind, array)]; out_types: the outputs, the last one the final fp32 state
    [B, H, Dk, Dv] (written here; the others by `step`). step(slots, scratch, outs,
    where=(b, h, key cols, value cols), chunk, S) -> the tile after the chunk."""
  B, H, Dk, Dv = h0.shape
  n_chunks = inputs[0][1].shape[1] // C
  bk, bv = block_k, block_v
  n_in, n_out = len(inputs), len(out_types)

  def body(*refs):
    in_refs, h0_ref = refs[:n_in], refs[n_in]
    outs = refs[n_in + 1:n_in + 1 + n_out]
    slots = refs[n_in + 1 + n_out:2 * n_in + 1 + n_out]
    work, bars = refs[2 * n_in + 1 + n_out:-1], refs[-1]
    kt, vt = lax.axis_index("k"), lax.axis_index("v")
    h, bi = lax.axis_index("h"), lax.axis_index("b")
    kcols, vcols = pl.ds(kt * bk, bk), pl.ds(vt * bv, bv)

    def chunk_at(i):
      return n_chunks - 1 - i if reverse else i

    def fetch(i, slot):
      n = chunk_at(i)
      tok = pl.ds(n * C, C)
      for (kind, _), ref, buf in zip(inputs, in_refs, slots):
        src = {
            "keys": lambda: ref.at[bi, tok, h, kcols],
            "values": lambda: ref.at[bi, tok, h, vcols],
            "chunk_keys": lambda: ref.at[bi, n, h, kcols],
            "flags": lambda: ref.at[bi, tok]
        }[kind]()
        plgpu.copy_gmem_to_smem(src, buf.at[slot], bars.at[slot])

    prefetch(fetch, stages, n_chunks)

    def chunk_step(i, S):
      slot = next_slot(fetch, i, stages, n_chunks, bars)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # last chunk's stores are out
      return step([s.at[slot] for s in slots], work, outs, (bi, h, kcols, vcols), chunk_at(i), S)

    S = lax.fori_loop(0, n_chunks, chunk_step, load(h0_ref.at[bi, h, kcols, vcols]))
    outs[-1].at[bi, h, kcols, vcols][...] = S
    plgpu.wait_smem_to_gmem(0)

  slot_buffers = tuple(_slot_buffer(kind, arr, stages, bk, bv) for kind, arr in inputs)
  barrier = plgpu.Barrier(num_arrivals=n_in, num_barriers=stages)
  walk = kernel(body, tuple(out_types), (Dk // bk, Dv // bv, H, B), ("k", "v", "h", "b"),
                slot_buffers + tuple(scratch) + (barrier,), name, interpret)
  return walk(*(arr for _, arr in inputs), h0.astype(F32))


def state_outputs(B, H, n_chunks, Dk, Dv, cd, *extra):
  """The walks' usual outputs: the tile entering every chunk [B, H, NT, Dk, Dv] (cd),
    any `extra` ShapeDtypeStructs, and the final fp32 state."""
  return (jax.ShapeDtypeStruct((B, H, n_chunks, Dk, Dv),
                               cd), *extra, jax.ShapeDtypeStruct((B, H, Dk, Dv), F32))
