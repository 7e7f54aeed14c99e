"""Linear attention on a sequence split over devices: state passing.

Where the activation rules split the sequence (fewer sequences than devices; the
target's 64 sequences on 2 x 64 devices), each device holds a contiguous range of every
sequence's tokens. A linear recurrence `S_t = A_t S_{t-1} + k_t (beta_t) v_t^T` is
linear in its state, so a device's range maps an incoming state S to `M S + L`:
  * L, the range's own final state, is the kernel's final state from a zero state;
  * M [Dk, Dk], the range's state transition, is the kernel's final state from the
    identity with v = 0 (the same kernel, so GLA's diagonal decay and KDA's delta rule
    alike, segment resets included: a reset inside the range zeroes M).
Every device gathers all ranges' (M, L), chains them up to its own range (a state does
not cross a range boundary where the segment changes), and runs the kernel once more
from that state for its outputs. Three kernel passes per device instead of one, and two
all-gathers of [Dk, Dk + Dv] per head: the alternative is the whole sequence gathered
onto every device. Gradients flow through the kernels' custom VJPs (initial state
included) and the all-gathers.

Kernel contract (`pallas_kernels.linear_attention`): fn(q, k, v, g, [beta], *, scale,
initial_state, segment_ids, output_final_state) -> (o, final_state), arrays [B, T, ...],
states [B, H, Dk, Dv] fp32.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from meshes.per_shard import sequence_axes, sequence_split, split_over_batch


def _incoming_states(transitions, finals, first_seg, last_seg, initial, n):
  """The state entering each of the n ranges: [n, B, H, Dk, Dv].

  transitions [n, B, H, Dk, Dk], finals [n, B, H, Dk, Dv]; first_seg / last_seg [n, B]:
  the segment id of each range's first and last token."""
  states = [initial]
  for j in range(n - 1):
    carried = jnp.einsum("bhij,bhjv->bhiv", transitions[j], states[-1],
                         precision=jax.lax.Precision.HIGHEST) + finals[j]
    same = (first_seg[j + 1] == last_seg[j])[:, None, None, None]
    states.append(jnp.where(same, carried, 0.0))
  return jnp.stack(states)


def split_recurrence_over_devices(fn):
  """fn (see module doc) run per device on its rows and its token range, the state passed
  between ranges; with the sequence whole on each device, `split_over_batch(fn)`."""
  by_rows = split_over_batch(fn)

  @functools.wraps(fn)
  def wrapped(q, k, v, g, *rest, scale=None, initial_state=None, segment_ids=None,
              output_final_state=False):
    kwargs = dict(scale=scale, initial_state=initial_state, segment_ids=segment_ids,
                  output_final_state=output_final_state)
    split = sequence_split(q)
    if split is None:
      return by_rows(q, k, v, g, *rest, **kwargs)
    mesh, rows, seq = split
    seq_axes = sequence_axes(seq)
    n = math.prod(mesh.shape[a] for a in seq_axes)
    B, T, H, Dk = q.shape
    if segment_ids is None:
      segment_ids = jnp.zeros((B, T), jnp.int32)
    if initial_state is None:
      initial_state = jnp.zeros((B, H, Dk, v.shape[-1]), jnp.float32)
    tokens, states, ranges = P(rows, seq), P(rows), P(seq, rows)

    def body(q, k, v, g, segment_ids, initial_state, *rest):
      b = q.shape[0]
      common = dict(scale=scale, segment_ids=segment_ids, output_final_state=True)
      eye = jnp.broadcast_to(jnp.eye(Dk, dtype=jnp.float32), (b, H, Dk, Dk))
      _, transition = fn(q, k, jnp.zeros(q.shape[:3] + (Dk,), v.dtype), g, *rest, initial_state=eye,
                         **common)
      _, own = fn(q, k, v, g, *rest, initial_state=None, **common)
      gather = lambda x: jax.lax.all_gather(x, seq_axes)
      incoming = _incoming_states(gather(transition), gather(own), gather(segment_ids[:, 0]),
                                  gather(segment_ids[:, -1]), initial_state.astype(jnp.float32), n)
      here = jax.lax.axis_index(seq_axes)
      o, final = fn(q, k, v, g, *rest, initial_state=incoming[here], **common)
      return o, final[None]

    o, finals = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(tokens,) * 5 + (states,) + (tokens,) * len(rest),
        out_specs=(tokens, ranges),
        check_vma=False,
    )(q, k, v, g, segment_ids, initial_state, *rest)
    # the last range's final state is the sequence's
    return o, (finals[-1] if output_final_state else None)

  return wrapped
