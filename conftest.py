"""Test-wide set-up: 8 simulated CPU devices before JAX starts, deterministic flags, and a
compilation cache shared by the test workers and the command-line runs they start."""

import os
import pathlib

# XLA:CPU's LLVM optimisation dominates most tests' compiles and changes no HLO
# program: without it the suite took 790 s instead of 954 s on two cores (a few tests that
# run many interpreted kernel steps get slower, the compile-bound ones much faster).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                      "--xla_backend_optimization_level=0 "
                      "--xla_llvm_disable_expensive_passes=true")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Many tests compile the same tiny train step (in-process and in the CLI runs they
# launch); a persistent cache compiles it once per test session. Environment variables,
# so that subprocesses share it.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      str(pathlib.Path(__file__).parent / ".cache" / "jax-tests"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "2")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
