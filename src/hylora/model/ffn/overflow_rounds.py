"""Dropless expert parallelism past the first all-to-all round (docs/moe.md).

A chunk's pairs, sorted by slot, form one block per destination rank. The first round
(expert_parallel.py) moves the first C rows of every block; the pairs beyond C move here,
in rounds r = 1, 2, ... of a padded [R, C', d] all_to_all carrying rows
[C + (r-1) C', C + r C') of every block, C' <= C (`moe.overflow_round_capacity`: few
rows overflow in a balanced step, and these buffers come on top of the first round's).
The receiving rank runs its local experts on them and returns the results with the
reverse all_to_all into the first round's per-pair outputs. Every device runs the same
number of rounds (`RoundPlan.trips`, a maximum over the mesh), so the collectives match;
one round's buffers are R*C' rows whatever the routing.

The backward repeats the rounds: it re-sends each round's rows with their output
cotangents, recomputes the local experts under jax.vjp with respect to the rows and the
LoRA factors (the frozen base weights get no gradient), sums the LoRA gradients in the
loop carry and sends the rows' gradients back to add into the tokens'. Autodiff through
the loop would keep every round's buffers alive for the backward instead.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values

from hylora.model.ffn.local_experts import local_experts, window_counts

# The expert weights that train (LoRA factors); the rest are frozen base weights.
TRAINED = ("lora_a", "lora_b")


class RoundPlan(NamedTuple):
  """A chunk's sends, as the rounds need them (arrays local to one device)."""
  order: jax.Array  # [P] pairs sorted by slot (stable): destination, local slot, token
  start: jax.Array  # [R] first sorted position bound for each rank
  per_dest: jax.Array  # [R] pairs bound for each rank
  recv_counts: jax.Array  # [R source, S] pairs each source sends this rank, per local slot
  trips: jax.Array  # [] rounds after the first; equal on every device
  in_first: jax.Array  # [P] the pair went in the first round (original pair order)


def rounds_after_first(per_dest: jax.Array, first: int, cap: int) -> jax.Array:
  """[] rounds of `cap` rows that the rows past `first` of the fullest block need."""
  return jnp.max(-(-jnp.maximum(per_dest - first, 0) // cap))


def _start(first: int, r, cap: int):
  return first + (r - 1) * cap


def _round_rows(plan: RoundPlan, r, first: int, cap: int):
  """Round r's send buffer [R * C']: the sorted position each row carries, and which rows
  carry one."""
  pos = _start(first, r, cap) + jnp.arange(cap, dtype=jnp.int32)
  valid = pos[None, :] < plan.per_dest[:, None]
  sorted_pos = jnp.where(valid, plan.start[:, None] + pos[None, :], 0)
  return sorted_pos.reshape(-1), valid.reshape(-1)


def _zeros_like_tokens(x, shape, dtype=None):
  # Inside shard_map a loop carry must enter typed as the body leaves it: varying over
  # the mesh axes the tokens vary over (all of them), which zeros_like(x) inherits.
  return jnp.zeros_like(x, dtype=dtype, shape=shape)


def _round_key(key, r):
  # Round 0 uses the chunk's key itself; each later round folds in its index.
  return None if key is None else jax.random.fold_in(key, r)


def overflow_rounds(y_first: jax.Array, x: jax.Array, weights: dict, key, plan: RoundPlan, *,
                    options: dict, first: int, cap: int, axis_name: str) -> jax.Array:
  """y_first [P, d] (the first round's per-pair outputs, zero past the first C of each
  destination), x [n, d] (the chunk's tokens, k pairs each) -> y_first with the outputs
  of the pairs past the first C written in.

  weights: the local experts' arrays for `expert_ffn` (slot axis local, inner dims
  whole); options: its other keyword arguments; key: the chunk's LoRA-dropout key or
  None; first: C, the rows of each block the first round moved; cap: C', rows per
  (device, destination) per later round; axis_name: the mesh axis of the all_to_all (the
  expert ranks)."""
  n, d = x.shape
  pairs = plan.order.shape[0]
  k = pairs // n
  ranks = plan.start.shape[0]

  def exchange(rows):
    blocks = jax.lax.all_to_all(rows.reshape(ranks, cap, -1), axis_name, 0, 0, tiled=True)
    return blocks.reshape(ranks * cap, -1)

  def forward(y_first, x, weights, key, plan):

    def one_round(r, out):
      sorted_pos, valid = _round_rows(plan, r, first, cap)
      pair = plan.order[sorted_pos]
      send = jnp.where(valid[:, None], jnp.take(x, pair // k, axis=0), jnp.zeros((), x.dtype))
      counts = window_counts(plan.recv_counts, _start(first, r, cap), cap)
      y = local_experts(exchange(send), counts, weights, options, _round_key(key, r))
      back = exchange(y.astype(out.dtype))
      return out.at[jnp.where(valid, pair, pairs)].set(back, mode="drop")

    # Written into the first round's outputs in place: no second [P, d] buffer.
    return jax.lax.fori_loop(1, plan.trips + 1, one_round, y_first)

  def forward_saving(y_first, x, weights, key, plan):
    # Differentiating a frozen weight here would silently give it no gradient: refuse.
    primals = lambda w: jax.tree.leaves(w, is_leaf=lambda p: hasattr(p, "perturbed"))
    moving = sorted(name for name, w in weights.items()
                    if name not in TRAINED and any(p.perturbed for p in primals(w)))
    if moving:
      raise ValueError(f"expert_parallel: the all-to-all rounds differentiate the experts' "
                       f"LoRA factors only, not the frozen {', '.join(moving)}")
    y_first, *args = custom_vjp_primal_tree_values((y_first, x, weights, key, plan))
    return forward(y_first, *args), tuple(args)

  def backward(residuals, dout):
    x, weights, key, plan = residuals
    if isinstance(dout, SymbolicZero):  # the outputs are not used
      return None, None, None, None, None
    trained = {name: w for name, w in weights.items() if name in TRAINED}
    frozen = {name: w for name, w in weights.items() if name not in TRAINED}

    def one_round(r, carry):
      dx, dtrained = carry
      sorted_pos, valid = _round_rows(plan, r, first, cap)
      pair = plan.order[sorted_pos]
      rows = jnp.concatenate(
          [jnp.take(x, pair // k, axis=0),
           jnp.take(dout, pair, axis=0).astype(x.dtype)], axis=1)
      recv = exchange(jnp.where(valid[:, None], rows, jnp.zeros((), x.dtype)))
      counts = window_counts(plan.recv_counts, _start(first, r, cap), cap)
      round_key = _round_key(key, r)  # the forward's masks

      def run(rows, trained):
        return local_experts(rows, counts, {**frozen, **trained}, options, round_key)

      y, pullback = jax.vjp(run, recv[:, :d], trained)
      d_rows, d_trained = pullback(recv[:, d:].astype(y.dtype))
      back = exchange(d_rows.astype(x.dtype)).astype(jnp.float32)
      dx = dx.at[jnp.where(valid, pair // k, n)].add(back, mode="drop")
      dtrained = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), dtrained, d_trained)
      return dx, dtrained

    zeros = (_zeros_like_tokens(x, (n, d), jnp.float32),
             jax.tree.map(lambda w: _zeros_like_tokens(x, w.shape, jnp.float32), trained))
    dx, dtrained = jax.lax.fori_loop(1, plan.trips + 1, one_round, zeros)
    dweights = {
        name: dtrained[name].astype(w.dtype) if name in trained else None
        for name, w in weights.items()
    }
    # The rows written here replace y_first's (zeros): their cotangent does not reach it.
    dy_first = jnp.where(plan.in_first[:, None], dout, jnp.zeros((), dout.dtype))
    return dy_first, dx.astype(x.dtype), dweights, None, None

  @jax.custom_vjp
  def rounds(y_first, x, weights, key, plan):
    return forward(y_first, x, weights, key, plan)

  rounds.defvjp(forward_saving, backward, symbolic_zeros=True)
  return rounds(y_first, x, weights, key, plan)
