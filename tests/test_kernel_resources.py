"""experiments.kernel_resources: the CUDA lowering on a CPU machine along Hopper's path
(Triton kernels, and Mosaic GPU kernels through their own lowering), the ptxas report
parser and the occupancy arithmetic (the Triton compile itself needs the triton package,
which the project does not depend on)."""
import argparse

import pytest

from experiments import kernel_resources as kr
from pallas_kernels.linear_attention.gla import Tiling

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


def test_code_bytes_counts_the_instructions_of_a_listing():
  listing = """	.section	.text.gla_chunk_scores,"ax",@progbits
.text.gla_chunk_scores:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /* 0x000fe400078e00ff */
        /*0020*/                   EXIT ;
"""
  assert kr.code_bytes(listing) == 3 * 16
  assert kr.code_bytes("") == 0


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
  # Dk = 16 here: Hopper's Mosaic GPU walks need 64 or 128, so every kernel is Triton; the
  # scores kernel sums the decays (no chunk_cumsum), the backward takes the sum's transpose
  assert {
      "gla_states", "gla_chunk_scores", "gla_chunk_outputs", "gla_state_grads",
      "gla_chunk_score_grads", "gla_chunk_value_grads", "gla_chunk_key_grads",
      "chunk_reverse_cumsum"
  } == set(kernels)
  assert not any(k.is_mosaic for k in kernels.values())
  assert kernels["gla_states"].num_stages == 3
  key_grads = kernels["gla_chunk_key_grads"]
  assert (key_grads.num_warps, key_grads.num_stages) == (4, 2)
  assert "tt.func" in key_grads.ttir and "tt.dot" in key_grads.ttir


_SHARED_LIMIT = 227 * 1024  # a program's shared memory on Hopper


@pytest.mark.parametrize(
    "op, options, walk, fused, alone",
    [
        ("linear_attention.kda", dict(forward="split"), "kda_states_mosaic", None, set()),
        # the default on Hopper; its forward alone applies T in the walk (the bench shape's 64
        # heads take the 128-wide value tile): T and beta slots beside the others
        ("linear_attention.kda", {}, None, "kda_forward_mosaic", {"kda_forward_mosaic"}),
        # GLA's forward alone: the same shared memory, the states not sent on (one row)
        ("linear_attention.gla", {}, None, "gla_forward_mosaic", set()),
        ("linear_attention.gla", dict(tiling=Tiling(forward="fused", decayed_rows="xla")), None,
         "gla_forward_mosaic", set()),
    ])
def test_mosaic_gpu_kernels_lower_for_hopper_at_the_benchmark_shape(op, options, walk, fused,
                                                                    alone):
  """Mosaic GPU's own lowering (not its interpreter) at Dk = Dv = 128: layouts, WGMMA
    operands, the shared memory of a program, in training and in the forward alone (a fused
    forward without the backward's states)."""
  kernels = kr.capture_kernels(op, "pallas", "bench", **options)
  mosaic = {k.name: k for k in kernels if k.is_mosaic}
  state_grads = op.rsplit(".", 1)[1] + "_state_grads_mosaic"
  assert set(mosaic) == {walk or fused, state_grads} | {n + kr.FORWARD_ALONE for n in alone}
  assert all(0 < k.mosaic_shared <= _SHARED_LIMIT for k in mosaic.values())
  if fused:  # a state warpgroup and an output warpgroup
    assert mosaic[fused].num_warps == 8 and walk is None
  # over 114 KiB of shared memory each: one program per SM
  assert kr.mosaic_resources(mosaic[state_grads]) == {
      "shared": mosaic[state_grads].mosaic_shared,
      "programs_per_sm": 1
  }


def test_an_option_is_key_equals_a_literal_or_a_string():
  assert kr._option("forward=fused") == ("forward", "fused")
  assert kr._option("block_v=64") == ("block_v", 64)
  with pytest.raises(argparse.ArgumentTypeError, match="expected KEY=VALUE"):
    kr._option("fused")


def test_fp8_casts_lower_at_hoppers_compute_capability():
  """Pallas's Triton lowering compares the compute capability as a number (fp8 casts need
    89 or more): the block-FP8 kernels lower as on the H200."""
  kernels = kr.capture_kernels("quantized_matmul", "pallas", "small")
  assert {k.name for k in kernels} == {
      "quantized_grouped_matmul_fp8_block", "quantized_grouped_matmul_fp8_block_transposed"
  }
  assert all("tt.fp_to_fp" in k.ttir or "f8E4M3FN" in k.ttir for k in kernels)


# implementations that lower to cuDNN, which needs a GPU to lower at all
_CUDNN = {("attention.causal", "cudnn"), ("sparse_attention.attend", "by_density"),
          ("sparse_attention.attend", "masked_dense")}


def test_every_registered_implementation_lowers_for_hopper():
  """Each op's implementations at its small check shapes, forward and backward, through
    the CUDA lowering of Pallas (Triton and Mosaic GPU) and XLA: a kernel that only its
    interpreter had run fails here, not in a GPU call."""
  from experiments.op_checks import CHECKS
  from hylora.ops import catalog

  lowered = {}
  for op in catalog().names():
    if op not in CHECKS:
      continue
    for impl in catalog().entry(op).impls:
      if (op, impl) not in _CUDNN:
        lowered[op, impl] = {k.name for k in kr.capture_kernels(op, impl, "small")}
  pallas = {key: names for key, names in lowered.items() if key[1] == "pallas"}
  assert len(pallas) >= 8 and all(pallas.values()), pallas
  assert {"sparse_attention_forward",
          "sparse_attention_backward_dq"} <= pallas["sparse_attention.attend", "pallas"]
