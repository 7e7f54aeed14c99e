"""experiments/bench_kernel_constants.py on CPU (kernels interpreted), at a tiny shape: each
setting's op is traced under its constants, which are restored after; bad settings are
refused with the reason."""
import json

import jax.numpy as jnp
import numpy as np
import pytest

from experiments import bench_kernel_constants as bench
from pallas_kernels.linear_attention import _chunk_factors, _kda_scores


def test_settings_parse_and_bad_ones_are_refused():
  name, patches = bench.parse_setting(
      "b32:_kda_scores.HALVES_BLOCK_D=32;_chunk_factors.HALF_LIMIT=1.5")
  assert name == "b32"
  assert patches == [(_kda_scores, "HALVES_BLOCK_D", 32), (_chunk_factors, "HALF_LIMIT", 1.5)]
  assert bench.parse_setting("s:op.decay_sum='in_scores';_kda_scores.HALVES_BLOCK_D=32") == ("s", [
      (bench.OP, "decay_sum", "in_scores"), (_kda_scores, "HALVES_BLOCK_D", 32)
  ])
  for spec, match in (("_kda_scores.HALVES_BLOCK_D=32", "expected NAME:"),
                      ("x:_kda_scores.HALVES_BLOCK_D", "is not MODULE.CONSTANT=VALUE"),
                      ("x:_kda_scores.NO_SUCH=1", "has no NO_SUCH"), ("x:_no_such_module.X=1",
                                                                      "No module named")):
    with pytest.raises((ValueError, ModuleNotFoundError), match=match):
      bench.parse_setting(spec)


def test_constants_hold_while_tracing_and_are_restored():
  """HALF_LIMIT = -1 sends the HALVES chunks of strong gates down the sub-chunk path: the
    outputs move by rounding alone, so the constant was in place when the op was traced; after
    it, the module holds its own value again, also when the block raises."""
  x = bench.inputs(1, 128, 1, 32, gates="logsigmoid_strong")
  own = _chunk_factors.HALF_LIMIT
  plain = bench.compiled("gla", [], x)[0]()
  sub_chunks = bench.compiled("gla", [(_chunk_factors, "HALF_LIMIT", -1.0)], x)[0]()
  assert _chunk_factors.HALF_LIMIT == own
  a, b = (np.asarray(o, np.float32) for o in (plain, sub_chunks))
  assert not np.array_equal(a, b)
  np.testing.assert_allclose(a, b, rtol=0.05, atol=0.05)
  with pytest.raises(RuntimeError):
    with bench.patched([(_chunk_factors, "HALF_LIMIT", 0.0)]):
      raise RuntimeError
  assert _chunk_factors.HALF_LIMIT == own


def test_an_op_keyword_reaches_the_op_and_an_unknown_one_is_refused():
  """op.scale=0.5 halves chunked_gla's query scale: its output differs from the default's
    (by more than rounding); a keyword the op does not take is refused before any tracing."""
  x = bench.inputs(1, 64, 1, 32)
  plain = np.asarray(bench.compiled("gla", [], x)[0](), np.float32)
  forward = lambda spec: np.asarray(
      bench.compiled("gla",
                     bench.parse_setting(spec)[1], x)[0](), np.float32)
  halved, own_scale = forward("h:op.scale=0.5"), forward(f"o:op.scale={32 ** -0.5}")
  np.testing.assert_array_equal(own_scale, plain)
  assert not np.allclose(halved, plain, rtol=0.05, atol=0.05)
  with pytest.raises(ValueError, match="op.no_such: chunked_gla takes no keyword no_such"):
    bench.traced_under("gla", bench.parse_setting("n:op.no_such=1")[1])
  with pytest.raises(ValueError, match="op.q: chunked_gla takes no keyword q"):
    bench.traced_under("gla", bench.parse_setting("n:op.q=1")[1])


def test_a_row_against_the_first_setting_without_jla():
  settings = [
      bench.parse_setting(s)
      for s in ("a:_kda_scores.HALVES_BLOCK_D=64", "b:_kda_scores.HALVES_BLOCK_D=16")
  ]
  row = bench.bench("gla", (1, 64, 1, 32), "logsigmoid", settings, peer=False, rounds=1, calls=1)
  assert row["baseline"] == "a" and row["gates"] == "logsigmoid"
  for kind in ("fwd", "fwdbwd"):
    assert set(row[kind]) == {"a", "b", "baseline_ms"}
    assert all(ms > 0 and ratio > 0 for ms, ratio in (row[kind]["a"], row[kind]["b"]))


def test_correctness_of_each_setting_under_its_constants(capsys):
  """--correctness: one line per setting after the reference's own; a setting that sends the
    HALVES chunks down the sub-chunk path is as exact as the default, so both were traced and
    run; the constant is restored after."""
  settings = [
      bench.parse_setting(s)
      for s in ("own:_gla_scores.HALVES_BLOCK_D=64", "sub_chunks:_chunk_factors.HALF_LIMIT=-1.0")
  ]
  own = _chunk_factors.HALF_LIMIT
  bench.check("gla", ["logsigmoid_strong"], settings, shape=(1, 64, 1, 16))
  assert _chunk_factors.HALF_LIMIT == own
  rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert [r["setting"] for r in rows] == ["reference[bfloat16]", "own", "sub_chunks"]
  for row in rows[1:]:
    assert set(row["rel_rms"]) == {"o", "dq", "dk", "dv", "dg"}
    assert all(err < 1e-2 for err in row["rel_rms"].values()), row
  assert rows[1]["rel_rms"] != rows[2]["rel_rms"]  # each traced under its own constants
