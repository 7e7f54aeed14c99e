"""experiments.kernel_resources: the CUDA lowering on a CPU machine, the ptxas report
parser and the occupancy arithmetic (the Triton compile itself needs the triton package,
which the project does not depend on)."""
import pytest

from experiments import kernel_resources as kr

_PTXAS = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'gla_chunk_scores' for 'sm_90a'
ptxas info    : Function properties for gla_chunk_scores
    248 bytes stack frame, 244 bytes spill stores, 240 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 248 bytes cumulative stack size
ptxas info    : Compile time = 514.134 ms
"""


def test_parse_ptxas_reads_registers_and_spills():
  assert kr.parse_ptxas(_PTXAS) == {
      "registers": 255,
      "spill_stores": 244,
      "spill_loads": 240,
      "stack": 248
  }
  with pytest.raises(ValueError, match="Used"):
    kr.parse_ptxas("ptxas info    : 0 bytes gmem")


@pytest.mark.parametrize(
    "registers, warps, shared, programs",
    [
        (255, 4, 40960, 2),  # gla_chunk_key_grads on the H200: Nsight Compute saw 2
        (128, 4, 0, 4),  # registers bound
        (32, 8, 0, 8),  # warps bound: 64 per SM
        (16, 1, 0, 32),  # programs bound
        (64, 4, 120 * 1024, 1),  # shared memory bound
        (100, 4, 0, 4),  # 100 registers round up to 104 per thread (blocks of 256 per warp)
    ])
def test_programs_per_sm(registers, warps, shared, programs):
  assert kr.programs_per_sm(registers, warps, shared) == programs


@pytest.mark.parametrize("programs, warps, cap", [(3, 4, 168), (4, 4, 128), (2, 4, 255),
                                                  (2, 8, 128)])
def test_register_cap_fits_the_programs(programs, warps, cap):
  assert kr.register_cap_for(programs, warps) == cap
  assert kr.programs_per_sm(cap, warps, 0) >= programs


def test_gla_lowers_for_cuda_without_a_gpu():
  kernels = {k.name: k for k in kr.capture_kernels("linear_attention.gla", "pallas", "small")}
  assert {
      "chunk_cumsum", "gla_states", "gla_chunk_scores_factored", "gla_chunk_scores_sub_chunks",
      "gla_chunk_outputs", "gla_state_grads", "gla_chunk_score_grads", "gla_chunk_value_grads",
      "gla_chunk_key_grads", "chunk_reverse_cumsum"
  } <= set(kernels)
  key_grads = kernels["gla_chunk_key_grads"]
  assert (key_grads.num_warps, key_grads.num_stages) == (4, 3)
  assert kernels["gla_states"].num_stages == 3
  assert "tt.func" in key_grads.ttir and "tt.dot" in key_grads.ttir
