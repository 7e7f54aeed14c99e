"""No library module holds a jax Array at module level.

A module-level Array is closed over by every jitted function that reads it, as a device
constant. A step lowered and compiled ahead of time (Trainer.compile) then expected one
input more than it was called with ("Computation compiled for N inputs but called with
N - 1"): the threshold top-K's sign-bit mask did this to the GPU train step. Constants
belong in NumPy or Python scalars, which trace as literals.
"""
import importlib
import pkgutil

import jax
import pytest

PACKAGES = ("hylora", "pallas_kernels", "meshes")


def _library_modules():
  for package in PACKAGES:
    root = importlib.import_module(package)
    yield package
    for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
      if ".tests" not in info.name and not info.name.rsplit(".", 1)[-1].startswith("test_"):
        yield info.name


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_level_jax_arrays(package):
  offenders = []
  for name in _library_modules():
    if name.split(".")[0] != package:
      continue
    module = importlib.import_module(name)
    offenders += [
        f"{name}.{attr}" for attr, value in vars(module).items() if isinstance(value, jax.Array)
    ]
  assert not offenders, f"module-level jax Arrays (use NumPy scalars/arrays): {offenders}"
