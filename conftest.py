"""Test-wide set-up: 8 simulated CPU devices before JAX starts, deterministic flags, and a
compilation cache shared by the test workers and the command-line runs they start (and
one scratch folder for those runs); under
-n, each worker on its own CPUs and the longest files first."""

import atexit
import os
import pathlib
import shutil
import tempfile

# XLA:CPU's LLVM optimisation dominates most tests' compiles and changes no HLO
# program: without it the suite took 790 s instead of 954 s on two cores (a few tests that
# run many interpreted kernel steps get slower, the compile-bound ones much faster).
os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
    "--xla_backend_optimization_level=0 "
    "--xla_llvm_disable_expensive_passes=true")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Many tests compile the same tiny train step (in-process and in the CLI runs they
# launch), and both workers the same small programs; a persistent cache compiles each once
# per test session (programs of 0.3 s and more: the two workers' repeats of short compiles
# pay for the cache's writes). Environment variables, so that subprocesses share it.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      str(pathlib.Path(__file__).parent / ".cache" / "jax-tests"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")
# One scratch folder per test session for the command-line runs (tests/cli_runs.py):
# made here by the test session's main process, before any -n worker starts (they inherit the
# variable and share the runs), and removed when that process ends.
if "HYLORA_CLI_SCRATCH" not in os.environ:
  os.environ["HYLORA_CLI_SCRATCH"] = tempfile.mkdtemp(prefix="hylora-cli-")
  atexit.register(shutil.rmtree, os.environ["HYLORA_CLI_SCRATCH"], ignore_errors=True)


def _keep_worker_to_its_cpus() -> None:
  """Under -n N, worker i keeps to its share of the CPUs (every N-th from the i-th; one
  CPU each when N is the CPU count), with all its threads and the processes it starts.
  XLA:CPU runs many threads per process (one per simulated device, LLVM workers) that
  busy-wait before they sleep; unpinned, a worker's threads take time on the other
  worker's CPU for nothing: one test's compile took 92 CPU-seconds in 74 s unpinned,
  72 in 72 s on one CPU."""
  worker = os.environ.get("PYTEST_XDIST_WORKER", "")
  count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
  if not worker.startswith("gw") or count < 2 or not hasattr(os, "sched_setaffinity"):
    return
  cpus, index = sorted(os.sched_getaffinity(0)), int(worker[2:])
  mine = set(cpus[index::count]) if count <= len(cpus) else {cpus[index % len(cpus)]}
  for thread in os.listdir("/proc/self/task"):  # every thread the worker has so far
    try:
      os.sched_setaffinity(int(thread), mine)
    except OSError:
      pass


_keep_worker_to_its_cpus()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# Under -n, xdist hands out whole files (pyproject.toml: --dist loadfile) in collection
# order, the next one to a worker about to run out. These files take longest (runs of the
# command and of the notebook in subprocesses, the largest compiles; 25 s to 2 min each on
# two cores), longest first: they start at the beginning of a session and the many short
# files fill both workers at its end, rather than one long file running alone at the end.
# test_checkpoint's runs include the command's reference run (tests/cli_runs.py), which
# test_multihost and test_train read: listed after it, they find it done.
LONG_FILES_FIRST = (
    "tests/test_checkpoint.py",
    "tests/test_memory.py",
    "tests/test_dry_run.py",
    "tests/test_multihost.py",
    "tests/test_quantized_training.py",
    "tests/test_notebook.py",
    "tests/test_bench_multi_gpu.py",
    "tests/test_train.py",
    "tests/test_context_parallel.py",
    "tests/test_split_recurrence.py",
    "tests/test_gathered_keys.py",
    "pallas_kernels/linear_attention/tests/test_kda_kernel.py",
    "tests/test_align.py",
    "tests/test_balance_training.py",
    "tests/test_remat_memory.py",
    "tests/test_residual_mix.py",
    "tests/test_profile_part.py",
)


def pytest_collection_modifyitems(items):
  """Files of LONG_FILES_FIRST first, in its order; the others after, as collected."""
  rank = {path: i for i, path in enumerate(LONG_FILES_FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable
