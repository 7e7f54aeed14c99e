"""Small helpers shared by the Pallas (Triton backend) linear-attention kernels."""
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

SUB = 16  # sub-chunk length: per-channel decays are only ever exponentiated as exp(x <= 0)
F32 = jnp.float32


def interpret_mode():
    return jax.default_backend() == "cpu"


def compiler_params(num_warps=4, num_stages=1):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def compute_dtype(dtype):
    """Matmul operand dtype: bf16/f16 inputs stay bf16/f16; fp32 inputs stay fp32 (TF32
    tensor cores on GPU, exact in interpret mode)."""
    return dtype if dtype in (jnp.bfloat16, jnp.float16) else F32


def mm(a, b, cd, trans_a=False, trans_b=False):
    """a @ b (optionally transposed operands) with operands cast to cd and fp32 accumulation."""
    dims = (((0,) if trans_a else (1,)), ((1,) if trans_b else (0,)))
    return jax.lax.dot_general(a.astype(cd), b.astype(cd), (dims, ((), ())),
                               preferred_element_type=F32)


def rows(ref, start, n):
    """Rows [start, start + n) of a [T, D] ref, as fp32."""
    return ref[pl.ds(start, n), :].astype(F32)


def flag_column(ref, start, n=SUB):
    """Per-token 0/1 flags [start, start + n) of a [T] ref as an fp32 [n, 1] column."""
    return ref[pl.ds(start, n)].astype(F32)[:, None]


def masked_exp(x):
    """exp(min(x, 0)): decays are only ever exponentiated as exp(x <= 0); the clamp keeps
    masked-out entries (exponents of the wrong sign) finite before they are zeroed."""
    return jnp.exp(jnp.minimum(x, 0.0))


def iota(n, axis=0, shape=None):
    return jax.lax.broadcasted_iota(jnp.int32, shape or (n,), axis)


def row_as_column(x_row):
    """[1, D] -> [D, 1] (per-channel factor applied to the rows of a [D, Dv] state)."""
    return x_row.reshape(x_row.shape[1])[:, None]
