"""GPU check: each form of the in-chunk scores kernels against plain JAX in fp32, per gate
regime, on the device the kernels compile for.

    PYTHONPATH=src:. python3 -m experiments.linear_attention_scores_check \
        [--shape 1,4096,4,128] [--gates logsigmoid logsigmoid_strong kda_init]

The op-level correctness rows of bench_linear_attention.py say whether an output or a
gradient is wrong; this says which scores kernel makes it so. For each regime and each
form (_chunk_factors.SCORE_KERNELS) the largest absolute error of KDA's A_kk and A_qk and
of GLA's A against the same products formed per channel in plain JAX (A_kk and A are at
most 1 in magnitude for L2-normalised q, k: an error past ~1e-2 is a wrong kernel, not
rounding), and the share of chunks in each layout. One JSON line per regime; first, one
line on the mechanism the per-layout forms rest on (`two_pass_writes`): a second kernel
writing some blocks into the first one's output through input_output_aliases, each form
of it alone, which says whether the device keeps both kernels' writes.
"""
import argparse
import json

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from experiments.bench_linear_attention import GATES, inputs, layout_shares
from pallas_kernels.linear_attention import _chunk_prep, _gla_scores, _kda_scores
from pallas_kernels.linear_attention._chunk_factors import SCORE_KERNELS
from pallas_kernels.linear_attention._inputs import CHUNK, l2_normalize
from pallas_kernels.linear_attention._pallas_common import compiler_params, interpret_mode, iota
from pallas_kernels.linear_attention._pallas_common import store_where


def plain_scores(q, k, b, beta):
  """(A_kk, A_qk) [B, H, n, C, C] fp32 of one segment per row: every channel's decay
    exp(b_t - b_s) formed on its own."""
  B, Tp, H, D = k.shape
  n = Tp // CHUNK
  chunks = lambda x: x.astype(jnp.float32).reshape(B, n, CHUNK, H, -1).transpose(0, 3, 1, 2, 4)
  q, k, b = chunks(q), chunks(k), chunks(b)
  t, s = jnp.arange(CHUNK)[:, None], jnp.arange(CHUNK)[None, :]
  decay = jnp.exp(jnp.minimum(b[..., :, None, :] - b[..., None, :, :], 0.0))
  kk = jnp.einsum("bhntd,bhnsd,bhntsd->bhnts", k, k, decay)
  qk = jnp.einsum("bhntd,bhnsd,bhntsd->bhnts", q, k, decay)
  beta = beta.astype(jnp.float32).reshape(B, n, CHUNK, H).transpose(0, 3, 1, 2)[..., None]
  return jnp.where(s < t, beta * kk, 0.0), jnp.where(s <= t, qk, 0.0)


def max_error(x, ref):
  return float(jnp.max(jnp.abs(x.astype(jnp.float32) - ref)))


def check(shape, gates):
  """{form: errors} of every scores kernel form at one shape and gate regime."""
  B, T, H, D = shape
  q, k, v, g = inputs(*shape, seed=1, gates=gates)
  q, k = l2_normalize(q).astype(q.dtype), l2_normalize(k).astype(k.dtype)
  beta = jax.nn.sigmoid(jax.random.normal(jax.random.key(8), shape[:3], jnp.float32))
  q, k, v, b, runs = _chunk_prep.prepare(q, k, v, g, None, B, T)
  carry_in, in_last = _chunk_prep.segment_masks(runs)
  a_kk, a_qk = plain_scores(q, k, b, beta)
  row = {"shape": list(shape), "gates": gates, "layouts": layout_shares(g)}
  interpret = interpret_mode()
  for form in SCORE_KERNELS:
    try:
      kda = jax.jit(lambda q, k, b, beta, form=form: _kda_scores.chunk_scores(
          q, k, b, beta, runs, carry_in, in_last, cd=jnp.bfloat16, interpret=interpret, form=form))(
              q, k, b, beta)
      gla = jax.jit(lambda q, k, b, form=form: _gla_scores.chunk_scores(
          q, k, b, runs, interpret=interpret, form=form))(q, k, b)
      row[form] = {
          "kda_a_kk": max_error(kda[3], a_kk),
          "kda_a_qk": max_error(kda[4], a_qk),
          "gla_a": max_error(gla, a_qk)
      }
    except Exception as e:  # one form that does not compile does not hide the others
      row[form] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
  return row


TWO_PASS_FORMS = ("flag", "program_id", "flag_masked_stores")


def two_pass_write(form, n, size):
  """x [n, size, size] -> two kernels' output over its n blocks: the first writes the even
    blocks (x) and a flag per block, the second the odd ones (2 x) into the first one's
    output (input_output_aliases), deciding by the flag ("flag"), by its program id
    ("program_id"), or by the flag with masked stores, half the block from each of two
    ("flag_masked_stores"), as the scores' later kernels do."""
  block = pl.BlockSpec((None, size, size), lambda c: (c, 0, 0))
  flag = pl.BlockSpec((None, size), lambda c: (c, 0))

  def first(x_ref, o_ref, flag_ref):
    c = pl.program_id(0)
    flag_ref[...] = jnp.full((size,), c % 2, jnp.int32)
    jax.lax.cond(c % 2 == 0, lambda: o_ref.__setitem__(..., x_ref[...]), lambda: None)

  def second(x_ref, flag_ref, _o_in, o_ref):
    if form == "program_id":
      take = pl.program_id(0) % 2 == 1
    else:
      take = jnp.max(flag_ref[...]) == 1

    def write():
      if form == "flag_masked_stores":
        top = iota(size, 0, (size, size)) < size // 2
        store_where(o_ref, 0, top, 2 * x_ref[...])
        store_where(o_ref, 0, jnp.logical_not(top), 2 * x_ref[...])
      else:
        o_ref[...] = 2 * x_ref[...]

    jax.lax.cond(take, write, lambda: None)

  def run(x):
    interpret = interpret_mode()
    o, flags = pl.pallas_call(
        first, grid=(n,), in_specs=[block], out_specs=(block, flag),
        out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(
            (n, size), jnp.int32)), compiler_params=compiler_params(), interpret=interpret,
        name="two_pass_first")(x)
    return pl.pallas_call(second, grid=(n,), in_specs=[block, flag, block], out_specs=block,
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          input_output_aliases={2: 0}, compiler_params=compiler_params(),
                          interpret=interpret, name="two_pass_second")(x, flags, o)

  return run


def two_pass_writes(n=64, size=64):
  """{form: whether two_pass_write's output is right (or why it failed)} for each of
    TWO_PASS_FORMS."""
  x = jax.random.normal(jax.random.key(3), (n, size, size), jnp.float32)
  expected = jnp.where((jnp.arange(n) % 2 == 1)[:, None, None], 2 * x, x)
  out = {}
  for form in TWO_PASS_FORMS:
    try:
      out[form] = bool(jnp.array_equal(jax.jit(two_pass_write(form, n, size))(x), expected))
    except Exception as e:  # one form that does not compile does not hide the others
      out[form] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--shape", type=lambda s: tuple(map(int, s.split(","))),
                  default=(1, 4096, 4, 128))
  ap.add_argument("--gates", nargs="+", choices=GATES, default=list(GATES))
  args = ap.parse_args()
  print(json.dumps({"two_pass_writes_right": two_pass_writes()}), flush=True)
  for gates in args.gates:
    print(json.dumps(check(args.shape, gates)), flush=True)


if __name__ == "__main__":
  main()
