"""experiments.timing, the one timing policy of the benchmarks: how many calls go untimed,
what a comparison in alternating rounds reports, and that an absent peer is reported."""
import time

import jax.numpy as jnp
import pytest

from experiments import timing


def _counting(seconds=0.0):
  calls = []

  def fn(*args):
    calls.append(args)
    time.sleep(seconds)
    return jnp.zeros(())

  return fn, calls


def test_median_ms_times_reps_calls_after_the_first_and_the_warmup():
  fn, calls = _counting()
  ms = timing.median_ms(fn, 1, 2, warmup=2, reps=4)
  assert ms >= 0 and len(calls) == 1 + 2 + 4 and calls[0] == (1, 2)
  with pytest.raises(ValueError, match="warmup"):
    timing.median_ms(fn, warmup=0)


def test_interleaved_ratios_reports_both_sides_and_per_round_ratios():
  slow, slow_calls = _counting(0.004)
  fast, fast_calls = _counting(0.001)
  r = timing.interleaved_ratios({"fast": fast}, slow, rounds=5, calls=2)
  assert (r["rounds"], r["calls"]) == (5, 2)
  assert len(slow_calls) == len(fast_calls) == 2 + 5 * 2  # first call, warm-up, rounds
  assert r["baseline_ms"] > r["fast"]["ms"] > 0
  assert r["fast"]["min"] <= r["fast"]["median"] <= r["fast"]["max"]
  assert r["fast"]["median"] > 1.2  # baseline / candidate: > 1 when the candidate is faster
  assert len(r["baseline_round_ms"]) == len(r["fast"]["round_ms"]) == 5
  assert timing.median_ratio(r, None, "fast") == r["fast"]["median"]
  assert timing.median_ratio(r, "fast", None) < 1
  with pytest.raises(ValueError, match="taken"):
    timing.interleaved_ratios({"baseline_ms": fast}, slow, rounds=1, calls=1)


def test_an_absent_peer_is_reported_as_missing():

  def make():
    import a_peer_that_is_not_installed  # noqa: F401

  fn, why = timing.peer(make)
  assert fn is None and why.startswith("missing: ModuleNotFoundError")
  assert timing.peer(lambda: "ok") == ("ok", None)


def test_block_waits_on_mixed_outputs():
  out = [jnp.ones(3), None, "text", (jnp.zeros(2),)]
  assert timing.block(out) is out
