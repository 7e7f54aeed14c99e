"""experiments/bench_linear_attention.py at a tiny shape on CPU (kernels interpreted): the
per-kernel breakdowns call every GLA and KDA kernel, the fused forwards' included, and the
correctness checks report each setting of either op in each gate regime, so the benchmark keeps
up with the kernels' signatures. Each kernel runs once here (the GPU run repeats them)."""
import functools
import json
import time

import jax
import jax.numpy as jnp

from experiments import bench_linear_attention as bench
from pallas_kernels.linear_attention import chunked_gla, gla_chunked
from pallas_kernels.linear_attention.gla import Tiling


def _once(f, *args, **timing):
  del timing
  start = time.perf_counter()
  jax.block_until_ready(f(*args))
  return (time.perf_counter() - start) * 1e3


def test_breakdown_runs_every_kernel(monkeypatch):
  monkeypatch.setattr(bench, "median_ms", _once)
  ms = bench.kernel_breakdown((1, 128, 2, 64), Tiling())["kernel_ms"]
  for name in ("prepare", "states", "scores", "scores_by_layout", "scores_summing_decays",
               "outputs", "state_grads", "score_grads", "value_grads", "key_grads",
               "key_grads_by_layout", "fused.scores_with_decayed_rows", "fused.decayed_rows_xla",
               "fused.state_outputs", "fused.scores_summing_all_with_decayed_rows",
               "fused.scores_summing_chunk_ends_with_decayed_rows"):
    assert isinstance(ms.get(name), float) and ms[name] > 0, (name, ms.get(name))


def test_kda_breakdown_runs_every_kernel(monkeypatch):
  monkeypatch.setattr(bench, "median_ms", _once)
  ms = bench.kda_kernel_breakdown((1, 64, 1, 64))["kernel_ms"]
  for name in ("intra", "intra_with_inverse", "intra_with_inverse_solve_8_warps",
               "intra_by_layout_solve_in_scores", "intra_by_layout_solve_own_kernel",
               "intra_by_layout_inverse_whole_chunk", "of_which_scores", "scores_by_layout",
               "scores_normalizing_summing_decays", "scores_normalizing_q_k", "output", "dv_local",
               "wy_grads", "key_grads", "key_grads_8_warps", "key_grads_in_one_kernel",
               "key_grads_other_chunks_8_warps", "states_triton", "state_grads_triton",
               "states_mosaic", "state_grads_mosaic", "fused_states_outputs"):
    assert isinstance(ms.get(name), float) and ms[name] > 0, (name, ms.get(name))


def test_correctness_reports_each_setting_in_each_gate_regime(capsys):
  impls = [("", Tiling()), ("[block_k=32]", Tiling(block_k=32))]
  impls = [(name, functools.partial(chunked_gla, tiling=t)) for name, t in impls]
  bench.correctness("gla", impls, gla_chunked, bench.inputs_at, ["logsigmoid", "logsigmoid_strong"],
                    shape=(1, 128, 1, 64))
  rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert [(r["gates"], r["setting"]) for r in rows] == [("logsigmoid", "reference[bfloat16]"),
                                                        ("logsigmoid", ""),
                                                        ("logsigmoid", "[block_k=32]"),
                                                        ("logsigmoid_strong",
                                                         "reference[bfloat16]"),
                                                        ("logsigmoid_strong", ""),
                                                        ("logsigmoid_strong", "[block_k=32]")]
  for r in rows:
    assert set(r["rel_rms"]) == {"o", "dq", "dk", "dv", "dg"}
    assert all(e < 1e-2 for e in r["rel_rms"].values()), r


def test_kda_correctness_reports_each_setting(capsys):
  """Each setting asked for, named by how it differs from chunked_kda's defaults."""
  bench.bench_kda([], skip_reference=True, forwards=("fused",), gates=("logsigmoid_strong",),
                  scores=("one_kernel",), qk_norm=("xla",), solve=("own_kernel", "in_scores"),
                  correctness_shape=(1, 64, 1, 64))
  rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert [r["setting"] for r in rows] == [
      "reference[bfloat16]", "pallas[forward=fused,scores=one_kernel,qk_norm=xla]",
      "pallas[forward=fused,scores=one_kernel,qk_norm=xla,solve=in_scores]"
  ]
  for r in rows:
    assert r["gates"] == "logsigmoid_strong"
    assert set(r["rel_rms"]) == {"o", "dq", "dk", "dv", "dg", "dbeta"}
    assert all(e < 1e-2 for e in r["rel_rms"].values()), r


def test_skip_correctness_leaves_only_the_timed_shapes(capsys, monkeypatch):
  for op in ("gla", "kda"):
    monkeypatch.setattr("sys.argv",
                        ["bench", "--op", op, "--peers", "none", "--shapes", "--skip-correctness"])
    bench.main()
    assert capsys.readouterr().out.splitlines() == [str(jax.devices())]


def test_kda_init_gates_decay_fast_in_some_chunks_yet_factor_through_one_anchor():
  """--gates kda_init: per-token decays down to -1.6..-2.5 in the heads with a large A, so
    that some chunks decay by more than a sub-chunk's anchor allows (2 * FACTOR_LIMIT), and
    every chunk within the whole-chunk limit (2 * WHOLE_LIMIT), as with the default gates."""
  from pallas_kernels.linear_attention import _chunk_factors as factors
  from pallas_kernels.linear_attention._diagonal_blocks import FACTOR_LIMIT
  _, _, _, g = bench.inputs(1, 1024, 16, 64, gates="kda_init")
  assert float(g.max()) < 0 and -3.0 < float(g.min()) < -1.25
  b = jnp.cumsum(g.reshape(1, 16, factors.C, 16, 64), axis=2)
  widest = float(jnp.max(b.max(axis=2) - b.min(axis=2)))
  assert 2 * FACTOR_LIMIT < widest < 2 * factors.WHOLE_LIMIT, widest
  assert bench.layout_shares(g)["whole_chunk"] == 1.0
  assert bench.layout_shares(bench.inputs(1, 1024, 16, 64)[3])["whole_chunk"] == 1.0


def test_strong_logsigmoid_gates_need_one_anchor_per_sub_chunk():
  """--gates logsigmoid_strong: about -3 a token, past the whole-chunk limit (-1.9 a token
    on average over a chunk) in nearly every block, within the per-sub-chunk one in most."""
  _, _, _, g = bench.inputs(1, 1024, 16, 64, gates="logsigmoid_strong")
  assert -3.5 < float(g.mean()) < -2.5
  shares = bench.layout_shares(g)
  assert shares["whole_chunk"] < 0.1 and shares["per_sub_chunk"] > 0.5, shares
  # the scores take every such chunk by halves
  assert shares["scores_halves"] > 0.9 and shares["scores_sub_chunks"] == 0.0, shares


def test_breakdown_once_per_distinct_kernel_setting():
  """Settings that differ only in which kernels the breakdown times side by side anyway
    (the fused forward, its decayed rows, the scores' and the key gradients' splits) share
    one breakdown."""
  tilings = [
      bench.parse_tiling(s)
      for s in ("", "scores=one_kernel", "forward=fused", "forward=fused,decayed_rows=xla",
                "key_grads=by_layout", "block_k=32")
  ]
  assert bench.breakdown_tilings(tilings) == [Tiling(), Tiling(block_k=32)]


def test_kda_forwards_default_to_the_ops_own(monkeypatch):
  from pallas_kernels.linear_attention import _mosaic_common
  assert bench.default_kda_forwards() == ["split"]  # here, the CPU
  monkeypatch.setattr(_mosaic_common, "on_hopper", lambda: True)
  assert bench.default_kda_forwards() == ["fused"]


def test_forward_stages_time_every_stage_of_ours(monkeypatch):
  """experiments/linear_attention_forward_stages.py: each of our forward's stages runs (the
  Mosaic GPU walk only on Hopper); jla's side needs a GPU and is reported as failed here."""
  from experiments import linear_attention_forward_stages as stages
  monkeypatch.setattr(stages, "median_ms", _once)
  x = bench.inputs(1, 128, 1, 64, gates="logsigmoid_strong")
  beta = jax.nn.sigmoid(jax.random.normal(jax.random.key(7), (1, 128, 1)))
  ms = stages.ours(*x, beta)
  for name in ("normalize", "cumsum", "scores", "scores_by_layout", "scores_by_layout_normalizing",
               "scores_and_solve", "scores_by_layout_then_solve", "scores_by_layout_solving",
               "forward", "forward_qk_norm_xla", "forward_decay_sum_in_scores",
               "forward_value_tile_64"):
    assert ms[name] > 0, (name, ms)


def test_scores_check_finds_every_scores_kernel_exact_in_every_regime():
  """experiments/linear_attention_scores_check.py at a tiny shape (interpreted): each
  scores kernel form within rounding of the per-channel plain-JAX products, in the
  regimes that take WHOLE_CHUNK and HALVES chunks; a wrong A (half of A_qk) is told."""
  from experiments import linear_attention_scores_check as check
  for gates in ("logsigmoid", "logsigmoid_strong"):
    row = check.check((1, 128, 1, 64), gates)
    for form in ("by_layout", "one_kernel"):
      assert max(row[form].values()) < 1e-2, (gates, form, row)
  q, k, v, g = bench.inputs(1, 128, 1, 64, gates="logsigmoid_strong")
  from pallas_kernels.linear_attention import _chunk_prep
  q, k, v, b, _ = _chunk_prep.prepare(q, k, v, g, None, 1, 128)
  beta = jax.numpy.ones((1, 128, 1))
  a_kk, a_qk = check.plain_scores(q, k, b, beta)
  assert check.max_error(a_qk / 2, a_qk) > 1e-2


def test_two_pass_writes_keep_both_kernels_blocks_interpreted_and_lower_for_hopper():
  """The scores check's probe of two kernels writing one output (through
  input_output_aliases): every form right where it is interpreted (on the GPU it says which
  form, if any, loses writes), and every form's two kernels lower for Hopper here."""
  from experiments import kernel_resources as kr
  from experiments import linear_attention_scores_check as check
  assert check.two_pass_writes(n=4, size=16) == {form: True for form in check.TWO_PASS_FORMS}
  x = jax.ShapeDtypeStruct((4, 16, 16), jax.numpy.float32)
  for form in check.TWO_PASS_FORMS:
    kernels = []
    with kr._lowering_for_cuda(kernels):
      jax.jit(check.two_pass_write(form, 4, 16)).trace(x).lower(lowering_platforms=("cuda",))
    assert [k.name for k in kernels] == ["two_pass_first", "two_pass_second"], form


def test_revision_bench_imports_a_revision_beside_this_tree(tmp_path, request):
  """bench_linear_attention_revision takes a revision's package under a name of its own (its
    modules import one another, not this tree's) and times two functions in one row."""
  import sys

  from experiments import bench_linear_attention_revision as revision
  import pallas_kernels.linear_attention as ours
  theirs = revision.import_revision("HEAD", tmp_path)
  request.addfinalizer(lambda: sys.path.remove(str(tmp_path)))
  for name in [m for m in sys.modules if m.startswith(theirs.__name__)]:  # on leaving
    request.addfinalizer(lambda name=name: sys.modules.pop(name, None))
  assert theirs.__name__ == "linear_attention_HEAD" and theirs.chunked_kda is not ours.chunked_kda
  assert theirs.chunked_kda.__module__ == "linear_attention_HEAD.kda"
  assert not [
      p for p in (tmp_path / theirs.__name__).rglob("*.py") if revision.PACKAGE in p.read_text()
  ]
  row = revision.compare("gla", theirs.gla_chunked, gla_chunked, (1, 64, 1, 16), "logsigmoid",
                         dict(rounds=1, calls=1))
  for kind in ("fwd", "fwdbwd"):
    assert row[kind]["revision_ms"] > 0 and row[kind]["revision_over_this"]["median"] > 0
