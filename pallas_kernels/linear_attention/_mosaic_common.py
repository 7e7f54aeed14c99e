"""Helpers shared by the Mosaic GPU (Hopper) linear-attention kernels."""
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

F32 = jnp.float32
WG = plgpu.Layout.WGMMA
ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a WGMMA-layout array
COL = plgpu.Layout.WGMMA.reduce(0)  # one value per column


def on_hopper():
  device = jax.devices()[0]
  return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"


def sixteen_bit(dtypes):
  """Whether the operands share one 16-bit dtype (warpgroup matmuls take bf16 or f16)."""
  return len(set(dtypes)) == 1 and dtypes[0] in (jnp.bfloat16, jnp.float16)


def require_mosaic(what, fits, interpret, requirement):
  """A clear error where a Mosaic GPU kernel was asked for and cannot run: inputs it does
    not take (`requirement` says which), or a GPU other than Hopper (it compiles for sm_90
    only; on CPU it runs under the interpreter)."""
  if not fits:
    raise ValueError(f"{what} needs {requirement}")
  if not interpret and not on_hopper():
    raise ValueError(f"{what} runs on a Hopper GPU (sm_90) or interpreted on CPU; this "
                     f"device is {jax.devices()[0].device_kind}")


def choose_mosaic_or(what, choice, choices, mosaic, fallback, fits, interpret, requirement):
  """`choice`, "auto" or a key of `choices`, one of which (`mosaic`) runs on Mosaic GPU:
    "auto" takes it where it fits and compiles (Hopper), else `fallback`; asking for it
    where it cannot run is an error (require_mosaic). `what` names the setting in errors."""
  if choice != "auto" and choice not in choices:
    raise ValueError(f"{what} = {choice!r}: expected 'auto' or one of {sorted(choices)}")
  if choice == mosaic:
    require_mosaic(f"{what} = {mosaic!r}", fits, interpret, requirement)
  if choice == "auto":
    return mosaic if fits and not interpret and on_hopper() else fallback
  return choice


def choose_walk(choice, walks, fits, interpret, requirement):
  """The state-walk implementation for `choice`: "mosaic" where "auto" can take it, else
    "triton"."""
  return choose_mosaic_or("state_walk", choice, walks, "mosaic", "triton", fits, interpret,
                          requirement)


# The fused forwards' value tile: a width, or "by_heads", chosen by the serial chains
# (batch rows x heads) as jla chooses its fused forward's (docs/kernel_tuning.md, "GLA and
# KDA fused forwards")
FORWARD_TILES = ("by_heads",)


def forward_value_tile(choice, B, H, Dv):
  """The fused forward's value channels per program (B H Dv / tile programs, each walking
    its chain of chunks) for `choice`, a width or "by_heads": 32 for at most 16 (batch row,
    head) chains, where the walk's latency bounds it and more, shorter chains help; 64 for
    at most 32; else 128, each chunk's keys read once per head. Capped at Dv."""
  if choice == "by_heads":
    chains = B * H
    choice = 32 if chains <= 16 else 64 if chains <= 32 else 128
  elif not isinstance(choice, int) or isinstance(choice, bool):
    raise ValueError(f"forward_block_v = {choice!r}: expected a width or one of "
                     f"{list(FORWARD_TILES)}")
  return min(choice, Dv)


def smem(shape, dtype, swizzle_row=None):
  """Shared memory tiled and swizzled for its minor dimension (or that of a
    `swizzle_row`-element row: the operands of one warpgroup matmul share a swizzle)."""
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle((swizzle_row or shape[-1]) * itemsize * 8)
  return plgpu.SMEM(
      shape, dtype, transforms=(plgpu.TilingTransform(
          (8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)))


def load(ref, layout=WG):
  return plgpu.load(ref, layout=layout, optimized=False)


def per_row(vector, shape):
  """A ROW-layout vector broadcast along the columns of a WGMMA-layout array."""
  return lax.broadcast_in_dim(vector, shape, [0])


def per_column(vector, shape):
  """A COL-layout vector broadcast along the rows."""
  return lax.broadcast_in_dim(vector, shape, [1])


def matmul(a, b, shape, interpret, init=None):
  """[init +] a @ b on the tensor cores (fp32 accumulator), a and b in shared memory."""

  def product(acc):
    plgpu.wgmma(acc, a, b)
    return acc[...]

  if init is None or interpret:  # the interpreter cannot start an accumulator from a value
    out = pl.run_scoped(product, plgpu.ACC(shape, F32))
    return out if init is None else init + out

  def update(acc):
    plgpu.wgmma(acc, a, b)

  return pl.run_state(update)(plgpu.ACC.init(init))


def kernel(body, out_type, grid, grid_names, scratch, name, interpret, **warpgroups):
  """plgpu.kernel with the lane-level lowering (shared memory keeps exactly the given
    transforms), fast exp, and the Mosaic GPU interpreter when asked for; `warpgroups`:
    num_threads and thread_name for warp-specialised kernels."""
  params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane, approx_math=True)
  return plgpu.kernel(body, out_type=out_type, grid=grid, grid_names=grid_names,
                      scratch_types=scratch, compiler_params=params, kernel_name=name,
                      interpret=plgpu.InterpretGPUParams() if interpret else None, **warpgroups)
