"""Two processes x 4 CPU devices (jax.distributed on localhost, gloo collectives) train
like one device, the expert dispatch's all-to-all crossing between them, and a killed
process takes the other one down quickly; plus the process-group settings from flags and
SLURM variables."""

import json
import socket
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cli_runs
from hylora.io.distributed import first_host, local_rows, resolve
from hylora.core.errors import ConfigError


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_match_one_device_and_a_dead_peer_stops_the_other():
  """The scaled 2p8t model (tests/cli_runs.py) on 2 processes x 4 CPU devices under the
  default plan (routed experts per device through the dropless all-to-all, the planner's
  remat) trains like it does on one device. The expert axis spans both processes, as it
  spans hosts in the reference plan (expert = 64 over hosts of 8 GPUs): every step's
  dispatch and combine cross between them. (Before XLA:CPU's concurrency-optimized
  scheduler was turned off for multi-process runs, hylora.io.distributed, this hung
  before the first step.)"""
  base, checked = cli_runs.SCALED_2P8T, 3
  single = cli_runs.scratch("scaled-2p8t-one-device")
  out, port = cli_runs.scratch("multihost"), _free_port()
  procs = [
      cli_runs.launch("--steps", str(cli_runs.STEPS), "--devices", "4", "--mesh.fsdp=1",
                      "--mesh.expert=8", "--out", str(out),
                      "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id",
                      str(i), base=base, log=cli_runs.scratch(f"multihost-{i}.log"))
      for i in range(2)
  ]
  one = cli_runs.launch("--steps",
                        str(checked), "--devices", "1", "--mesh.fsdp=1", "--mesh.expert=1", "--out",
                        str(single), base=base, log=cli_runs.scratch("one-device.log"))
  try:
    cli_runs.wait_for(lambda: len(cli_runs.metrics(out)) >= checked, procs[0], timeout=450,
                      what=f"{checked} steps on two processes")
    assert one.wait(timeout=900) == 0, cli_runs.scratch("one-device.log").read_text()[-2000:]
    got = cli_runs.metrics(out)[:checked]
    reference = cli_runs.metrics(single)
    assert [r["step"] for r in got] == list(range(checked))
    # Two programs (expert parallel on 8 devices, dropless on one) in bf16: the losses agree
    # to 2e-3 over the steps; the gradients are compared before the first update, after
    # which Adam's first steps (about lr x sign(g)) turn bf16 noise in near-zero gradient
    # entries into different updates.
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in reference], rtol=2e-3)
    np.testing.assert_allclose(got[0]["grad_norm"], reference[0]["grad_norm"], rtol=1e-2)
    assert all(r["dropped_fraction"] == 0 for r in got)
    plan = json.loads((out / "plan.json").read_text())
    assert (plan["processes"], plan["devices"], plan["mesh"]) == (2, 8, {"fsdp": 1, "expert": 8})
    assert plan["experts"]["dispatcher"] == "ep_alltoall" and not plan["experts"]["drops"]
    assert plan["memory"]["planned"]
    assert json.loads((single / "plan.json").read_text())["experts"]["dispatcher"] == "dropless"
    assert procs[0].poll() is None  # still training when its peer dies
    cli_runs.kill(procs[1])
    start = time.monotonic()
    procs[0].wait(timeout=90)
    waited = time.monotonic() - start
  finally:
    for proc in procs + [one]:
      cli_runs.kill(proc)
  log = cli_runs.scratch("multihost-0.log").read_text()
  assert procs[0].returncode != 0, log[-2000:]
  assert waited < 60, f"the surviving process took {waited:.0f} s to stop"
  assert len(cli_runs.metrics(out)) < cli_runs.STEPS


def test_an_unreachable_coordinator_is_one_line_naming_it():
  port = _free_port()  # nothing listens there
  start = time.monotonic()
  done = cli_runs.run("--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id",
                      "1", "--distributed-timeout", "2", "--devices", "4", timeout=120)
  assert time.monotonic() - start < 60
  assert done.returncode == 1
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(
      f"error: process 1 of 2: --coordinator 127.0.0.1:{port}: no coordination service "
      "answered within 2 s"), done.stderr


def test_process_group_from_flags_and_slurm():
  assert resolve() is None or resolve().source == "slurm"
  group = resolve("10.0.0.1:1234", 4, 3, env={})
  assert (group.coordinator, group.num_processes, group.process_id) == ("10.0.0.1:1234", 4, 3)
  with pytest.raises(ConfigError, match="--process-id"):
    resolve("10.0.0.1:1234", 4, None, env={})
  with pytest.raises(ConfigError, match=r"--process-id: must be in \[0, 4\)"):
    resolve("10.0.0.1:1234", 4, 4, env={})
  slurm = {
      "SLURM_NTASKS": "16",
      "SLURM_PROCID": "5",
      "SLURM_JOB_ID": "4097",
      "SLURM_STEP_NODELIST": "gpu[003-007,011],cpu1"
  }
  group = resolve(env=slurm)
  assert group == type(group)("gpu003:61441", 16, 5, "slurm")
  assert resolve(env={**slurm, "JAX_COORDINATOR_PORT": "5000"}).coordinator == "gpu003:5000"
  assert resolve(env={"SLURM_NTASKS": "1"}) is None
  assert first_host("node7") == "node7" and first_host("a1,b2") == "a1"


class _SecondProcessView:
  """A sharding as process 1 of 2 sees it: only devices 4-7 are its own."""

  def __init__(self, sharding):
    self.sharding = sharding

  def addressable_devices_indices_map(self, shape):
    return {d: i for d, i in self.sharding.devices_indices_map(shape).items() if d.id >= 4}


def test_each_process_feeds_its_rows():
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(2, 4), ("fsdp", "expert"))
  rows = NamedSharding(mesh, P(("fsdp", "expert")))
  assert local_rows(rows, (8, 64)) == slice(0, 8)  # one process holds every device
  assert local_rows(_SecondProcessView(rows), (8, 64)) == slice(4, 8)
  assert local_rows(_SecondProcessView(rows), (16, 64)) == slice(8, 16)
  by_fsdp = NamedSharding(mesh, P("fsdp"))  # replicated over `expert`: overlapping copies
  assert local_rows(_SecondProcessView(by_fsdp), (8, 64)) == slice(4, 8)
  assert local_rows(_SecondProcessView(NamedSharding(mesh, P())), (8, 64)) == slice(0, 8)
