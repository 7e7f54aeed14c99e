"""Small helpers shared by the Pallas (Triton backend) linear-attention kernels."""
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.linear_attention._inputs import CHUNK

SUB = 16  # sub-chunk length: per-channel decays are only ever exponentiated as exp(x <= 0)
N_SUB = CHUNK // SUB  # sub-chunks per chunk
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


def chunk_columns(cols=None):
  """The index of a chunk's [C, D] ref: all of it, or with cols (a pl.ds of channels) every
    row of those channels."""
  return (...,) if cols is None else (pl.ds(0, CHUNK), cols)


def store_decayed_rows(q, k, b, b_last, ci_ref, il_ref, qg_ref, kg_ref, cols=None):
  """The chunk's decayed rows, in qg_ref's and kg_ref's dtype: qg = q exp(b) carry_in and
    kg = k exp(b_last - b) in_last (q, k, b: the chunk's [C, D] rows, fp32, or with cols (a
    pl.ds of channels) those channels' [C, n]; b_last [1, D] or [1, n]: b's last row)."""
  at = chunk_columns(cols)
  qg_ref[at] = (q * jnp.exp(b) * flag_column(ci_ref, 0, CHUNK)).astype(qg_ref.dtype)
  kg = k * masked_exp(b_last - b) * flag_column(il_ref, 0, CHUNK)
  kg_ref[at] = kg.astype(kg_ref.dtype)


# The rows of the summed decays b that a scores kernel summing them itself writes
# (chunk_scores(summed_rows=...)):
#   all         every row: the backward and the split forward read them;
#   chunk_ends  each chunk's last row, which is all the fused forward alone reads after
#               the scores (its state factors), and every row of the chunks whose paths
#               read theirs back from memory (the SUB_CHUNKS ones; the HALVES ones too
#               unless their path takes the rows held in registers, as GLA's one kernel
#               does: _chunk_factors.HeldRows): the other rows are left unwritten
SUMMED_ROWS = ("all", "chunk_ends")


def chunk_ends_asked(summed_rows, from_gates):
  """Whether summed_rows (SUMMED_ROWS) asks for the chunk ends alone, which needs the decays
    summed by the kernel (from_gates)."""
  if summed_rows not in SUMMED_ROWS:
    raise ValueError(f"summed_rows = {summed_rows!r}: expected one of {list(SUMMED_ROWS)}")
  if summed_rows == "chunk_ends" and not from_gates:
    raise ValueError("summed_rows = 'chunk_ends' needs the decays summed in the scores "
                     "kernel (from_gates)")
  return summed_rows == "chunk_ends"


def sum_decays(g_ref, b_ref, interpret):
  """b = the in-chunk cumulative sum of the chunk's log decays g_ref [C, D] (fp32) into
    b_ref, for a scores kernel that sums them itself: the rest of the kernel loads b's rows
    from b_ref at each use (held from here, they spilled more:
    experiments/kernel_resources.py), as the later kernels and the backward do."""
  store_summed(jnp.cumsum(g_ref[...].astype(F32), axis=0), b_ref, interpret)


def store_summed(b, b_ref, interpret):
  """Every row of b [C, D] into b_ref; the barrier makes every thread's rows visible to the
    others before the kernel reads them back."""
  b_ref[...] = b
  if not interpret:
    plgpu.debug_barrier()


def chunk_decays(b_ref, summed_ref, *, from_gates, chunk_ends, interpret):
  """(b_ref, b, b_last) for a kernel that reads the in-chunk cumulative decay: the ref its
    rows are read from after this, the chunk's rows [C, D] fp32 and its last row [1, D].
    b_ref holds b, or with from_gates the log decays, summed into summed_ref: every row
    (sum_decays), or with chunk_ends in registers (summed_in_registers)."""
  if chunk_ends:
    return summed_ref, *summed_in_registers(b_ref, summed_ref)
  if from_gates:
    sum_decays(b_ref, summed_ref, interpret)
    b_ref = summed_ref
  return b_ref, rows(b_ref, 0, CHUNK), rows(b_ref, CHUNK - 1, 1)


def summed_in_registers(g_ref, b_ref):
  """(b, b_last) for a kernel writing the chunk_ends rows of b (SUMMED_ROWS): b = the
    in-chunk cumulative sum of g_ref [C, D] in registers and its last row [1, D], written
    to b_ref's last row. b falls in every channel, so its last row is each column's
    minimum: no row taken out of registers."""
  b = jnp.cumsum(g_ref[...].astype(F32), axis=0)
  last = jnp.min(b, axis=0, keepdims=True)
  b_ref[pl.ds(CHUNK - 1, 1), :] = last
  return b, last


def store_where(ref, start, region, x, row=None):
  """Columns [start, start + n) of the [C, C] ref take x [C, n] (in the ref's dtype) where
    region, all of them when region is None; with `row`, x [m, n] goes to rows [row, row +
    m) of those columns."""
  cols = (slice(None) if row is None else pl.ds(row, x.shape[0]), pl.ds(start, x.shape[1]))
  if region is None:
    ref[cols] = x.astype(ref.dtype)
  else:
    plgpu.store(ref.at[cols], x.astype(ref.dtype), mask=region)


def masked_exp(x):
  """exp(min(x, 0)): decays are only ever exponentiated as exp(x <= 0); the clamp keeps
    masked-out entries (exponents of the wrong sign) finite before they are zeroed."""
  return jnp.exp(jnp.minimum(x, 0.0))


def iota(n, axis=0, shape=None):
  return jax.lax.broadcasted_iota(jnp.int32, shape or (n,), axis)


def row_as_column(x_row):
  """[1, D] -> [D, 1] (per-channel factor applied to the rows of a [D, Dv] state)."""
  return x_row.reshape(x_row.shape[1])[:, None]


def chunk_call(kernel, grid, in_specs, out_specs, out_shape, *, num_warps, interpret, name,
               num_stages=1, input_output_aliases=None):
  """pallas_call on the logical grid (b, h, chunk, j); index maps take (b, h, c, j).

    Launched as (j, chunk, b, h): CUDA runs the first axis fastest, so the programs of
    one chunk (its sub-chunks or channel blocks) run side by side and share the chunk's
    loads through L2 instead of each reading them from HBM (measured: docs/kernel_tuning.md,
    "Launch order of the parallel kernels")."""

  def launch_order(spec):
    return pl.BlockSpec(spec.block_shape, lambda j, c, b, h, f=spec.index_map: f(b, h, c, j))

  in_specs, out_specs = jax.tree.map(launch_order, (in_specs, out_specs),
                                     is_leaf=lambda s: isinstance(s, pl.BlockSpec))
  return pl.pallas_call(kernel, grid=(grid[3], grid[2], grid[0], grid[1]), in_specs=in_specs,
                        out_specs=out_specs, out_shape=out_shape,
                        compiler_params=compiler_params(num_warps, num_stages), interpret=interpret,
                        name=name, input_output_aliases=input_output_aliases or {})
