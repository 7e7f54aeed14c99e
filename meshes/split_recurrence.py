"""Linear attention on a sequence split over devices: state passing by a scan across devices.

Where the activation rules split the sequence (fewer sequences than devices; one
1M-token sequence over every device of the mesh), each device holds a contiguous range
of every sequence's tokens. A linear recurrence `S_t = A_t S_{t-1} + k_t (beta_t) v_t^T`
is linear in its state, so a device's range maps an incoming state S to `M S + L`:
L is the range's own final state from a zero state, M [Dk, Dk] its state transition
(the final state from the identity with v = 0; the same kernel, so GLA's diagonal decay
and KDA's delta rule alike, a reset inside the range zeroing M). The value channels of
the recurrence never mix, so one kernel pass with v' = [0 | v] from the state [I | 0]
ends in [M | L].

The state entering each device is then a prefix of the composition of these affine
maps, which is associative: a Hillis-Steele scan across devices (one `ppermute` of
[Dk, Dk + Dv] per head and round, log2(P) rounds) instead of gathering every range's
(M, L) onto every device and chaining P of them there. One more `ppermute` hands device
i the end state of device i - 1, and a second kernel pass from that state gives the
outputs: two passes per device, and no device holds more than its own (M, L) and one
received. A state never crosses a document boundary: where a device's first token
starts a new document (its segment id differs from the previous device's last one), its
M and its incoming state are zero. Gradients come by autodiff: a `ppermute` transposes to the reverse one, the
kernels have custom VJPs (initial state included).

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

_HIGHEST = jax.lax.Precision.HIGHEST


def compose(earlier, later):
  """The affine map S -> M S + L of `earlier` followed by `later`, each (M, L) with M
  [..., Dk, Dk] and L [..., Dk, Dv]: (M_later M_earlier, M_later L_earlier + L_later),
  in fp32."""
  m_a, l_a = (x.astype(jnp.float32) for x in earlier)
  m_b, l_b = (x.astype(jnp.float32) for x in later)
  m = jnp.einsum("...ij,...jk->...ik", m_b, m_a, precision=_HIGHEST)
  l = jnp.einsum("...ij,...jv->...iv", m_b, l_a, precision=_HIGHEST) + l_b
  return m, l


def scan_rounds(n: int) -> list[int]:
  """The device offsets of a Hillis-Steele scan over n devices: 1, 2, 4, ... < n."""
  return [1 << r for r in range(max(n - 1, 0).bit_length())]


def _from_previous(x, axes, n, shift=1):
  """x of device i - shift on device i (zeros on the first `shift` devices)."""
  return jax.lax.ppermute(x, axes, [(j, j + shift) for j in range(n - shift)])


def _inclusive_scan(m, l, axes, n):
  """Per device i, the composition of the maps of devices 0..i: its L (its M is only
  needed between rounds, so the last round sends L alone). M and L travel as one
  [..., Dk, Dk + Dv] array: one `ppermute` a round."""
  here = jax.lax.axis_index(axes)
  dk = m.shape[-1]
  rounds = scan_rounds(n)
  for r, shift in enumerate(rounds):
    if r == len(rounds) - 1:
      got_m, got_l = m, _from_previous(l, axes, n, shift)  # the composed M is not needed
    else:
      got = _from_previous(jnp.concatenate([m, l], axis=-1), axes, n, shift)
      got_m, got_l = got[..., :dk], got[..., dk:]
    new_m, new_l = compose((got_m, got_l), (m, l))
    has = here >= shift
    m, l = jnp.where(has, new_m, m), jnp.where(has, new_l, l)
  return l


def transition_and_own_state(fn, q, k, v, g, rest, common):
  """(M [b, H, Dk, Dk], L [b, H, Dk, Dv]) of the range of tokens q, k, v, g, *rest by
  the kernel fn (keyword arguments `common`, output_final_state=True among them)."""
  b, _, h, dk = q.shape
  dv = v.shape[-1]
  eye = jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), (b, h, dk, dk))
  try:
    widened = jnp.concatenate([jnp.zeros(v.shape[:3] + (dk,), v.dtype), v], axis=-1)
    start = jnp.concatenate([eye, jnp.zeros((b, h, dk, dv), jnp.float32)], axis=-1)
    _, both = fn(q, k, widened, g, *rest, initial_state=start, **common)
    return both[..., :dk], both[..., dk:]
  except ValueError:
    # A kernel without tiles for Dk + Dv value channels (the Pallas kernels take powers
    # of two): one pass each, three per device in all. A genuine input error raises
    # again below.
    _, transition = fn(q, k, jnp.zeros(v.shape[:3] + (dk,), v.dtype), g, *rest, initial_state=eye,
                       **common)
    _, own = fn(q, k, v, g, *rest, initial_state=None, **common)
    return transition, own


def split_recurrence_over_devices(fn):
  """fn (see module doc) run per device on its rows and its token range, the state passed
  between ranges; with the sequence whole on each device, `split_over_batch(fn)`."""
  by_rows = split_over_batch(fn)

  @functools.wraps(fn)
  def wrapped(q, k, v, g, *rest, scale=None, initial_state=None, segment_ids=None,
              output_final_state=False, **options):
    # options: the kernel's own (KDA's normalize_qk), passed on unchanged
    kwargs = dict(scale=scale, initial_state=initial_state, segment_ids=segment_ids,
                  output_final_state=output_final_state, **options)
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
      # a linear index over seq_axes in the order PartitionSpec splits the sequence
      here = jax.lax.axis_index(seq_axes)
      common = dict(scale=scale, segment_ids=segment_ids, output_final_state=True, **options)
      m, l = transition_and_own_state(fn, q, k, v, g, rest, common)
      initial = initial_state.astype(jnp.float32)
      previous_last = _from_previous(segment_ids[:, -1], seq_axes, n)
      # the first device carries the given initial state; a device whose first token
      # starts a new document carries nothing in
      fresh = ((segment_ids[:, 0] != previous_last) & (here > 0))[:, None, None, None]
      first = here == 0
      l = jnp.where(first, compose((jnp.zeros_like(m), initial), (m, l))[1], l)
      m = jnp.where(first | fresh, 0.0, m)
      end = _inclusive_scan(m, l, seq_axes, n)
      incoming = jnp.where(first, initial, _from_previous(end, seq_axes, n))
      incoming = jnp.where(fresh, 0.0, incoming)
      o, final = fn(q, k, v, g, *rest, initial_state=incoming,
                    **(common | dict(output_final_state=output_final_state)))
      return (o, final[None]) if output_final_state else o

    o = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(tokens,) * 5 + (states,) + (tokens,) * len(rest),
        out_specs=(tokens, ranges) if output_final_state else tokens,
        check_vma=False,
    )(q, k, v, g, segment_ids, initial_state, *rest)
    if not output_final_state:
      return o, None
    o, finals = o
    return o, finals[-1]  # the last range's final state is the sequence's

  return wrapped
