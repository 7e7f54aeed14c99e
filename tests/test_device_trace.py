"""hylora.profile.device_trace: busy time, idle gaps and per-instruction time from trace events."""

import jax
import jax.numpy as jnp
import pytest

from hylora.profile import device_trace


def _meta(kind, pid, name, tid=None):
  e = {"ph": "M", "name": kind, "pid": pid, "args": {"name": name}}
  return e if tid is None else {**e, "tid": tid}


def _kernel(pid, tid, ts, dur, op=None, name="kernel"):
  return {
      "ph": "X",
      "pid": pid,
      "tid": tid,
      "ts": ts,
      "dur": dur,
      "name": name,
      "args": {
          "hlo_op": op
      } if op else {}
  }


EVENTS = [
    _meta("process_name", 1, "/host:CPU"),
    _meta("process_name", 2, "/device:GPU:0"),
    _meta("process_name", 3, "/device:GPU:1"),
    _meta("thread_name", 2, "Stream #14(Compute)", tid=10),
    _meta("thread_name", 2, "Stream #15(MemcpyH2D)", tid=11),
    _meta("thread_name", 2, "XLA Ops", tid=99),
    _kernel(2, 10, 0.0, 10.0, "fusion.1"),
    _kernel(2, 11, 5.0, 10.0, "copy.2"),  # overlaps the first: busy 0..15
    _kernel(2, 10, 20.0, 5.0, "fusion.1"),  # 5 us idle before it
    _kernel(2, 10, 40.0, 4.0, name="MemcpyD2H"),  # no instruction: its own name; 15 us idle
    _kernel(2, 99, 100.0, 50.0, "fusion.1"),  # the ops line repeats the kernels: not counted
    _kernel(3, 10, 0.0, 500.0, "fusion.9"),  # another device
    _kernel(1, 1, 0.0, 900.0, "python"),  # the host
]


@pytest.mark.parametrize("runs", [1, 2])
def test_timeline_merges_overlaps_and_sums_per_instruction(runs):
  t = device_trace.timeline(EVENTS, runs=runs)
  assert t.events == 4
  assert t.busy_ms == pytest.approx(0.024 / runs) and t.span_ms == pytest.approx(0.044 / runs)
  assert t.idle_ms == pytest.approx(0.020 / runs)
  assert t.by_instruction_us == pytest.approx({
      "fusion.1": 15.0 / runs,
      "copy.2": 10.0 / runs,
      "MemcpyD2H": 4.0 / runs
  })
  assert list(t.by_instruction_us) == ["fusion.1", "copy.2", "MemcpyD2H"]  # largest first
  # longest first; "before" is the event that ended last
  assert t.gaps == [
      pytest.approx((0.015, "fusion.1", "MemcpyD2H")),
      pytest.approx((0.005, "copy.2", "fusion.1"))
  ]


def test_no_device_events_gives_none():
  assert device_trace.timeline([]) is None
  assert device_trace.timeline([e for e in EVENTS if e["pid"] == 1]) is None


def test_cpu_trace_has_host_events_and_no_device_timeline():
  f = jax.jit(lambda x: jnp.sin(x) @ x.T)
  x = jnp.ones((64, 64))
  events = device_trace.record(lambda: f(x), runs=2)
  assert any(e.get("ph") == "X" for e in events)  # the host's own activity is recorded
  assert device_trace.timeline(events, runs=2) is None
