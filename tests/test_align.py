"""Loss-curve alignment on a tiny model: the fast path (on CPU: the chunked
cross-entropy) against the plain-JAX reference ops, same seed and batches."""

import dataclasses

import jax

from experiments import align
from hylora.core.config import MemoryConfig, MeshConfig
from tests.helpers import small_config


def _tiny_one_device():
  cfg = small_config()
  model = dataclasses.replace(cfg.model, layers=2, pattern=("linear", "sparse"), dense_layers=1)
  return dataclasses.replace(cfg, model=model, mesh=MeshConfig(fsdp=1, expert=1),
                             memory=MemoryConfig(remat="none"),
                             train=dataclasses.replace(cfg.train, batch_size=4))


def test_fast_path_loss_curve_stays_within_the_stated_bound():
  report = align.align(_tiny_one_device(), steps=4, devices=jax.devices()[:1])
  assert report["differing_ops"] == {"cross_entropy": ["chunked", "reference"]}
  assert abs(report["diff"][0]) < 1e-5  # before any update: the forward agrees to fp32
  assert report["max_abs_diff"] <= align.DEFAULT_BOUND
  assert all(abs(d) > 0 for d in report["diff"][2:])  # the two runs really differ


def test_reference_kernels_sets_every_kernel_field():
  cfg = align.reference_kernels(small_config())
  assert set(dataclasses.asdict(cfg.kernels).values()) == {"reference"}
  assert align.kernel_differences(cfg) == {}


def test_bad_command_line_prints_one_error_line(capsys):
  assert align.main(["--steps", "0"]) == 2
  assert align.main(["--model.layers=0"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 2 and all(line.startswith("error: ") for line in err)
