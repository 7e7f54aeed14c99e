"""In-kernel building blocks of the KDA Pallas kernels: one 64-token chunk, fp32 values.

Decayed scores A[t, s] = sum_d x_t[d] k_s[d] exp(b_t[d] - b_s[d]) (b: in-chunk cumulative log
decay, non-increasing) never go through a [C, C, D] tensor and never exponentiate a positive
number: keys in an earlier 16-token sub-chunk take the decay split at the end of the
sub-chunk before the query's, (x_t exp(b_t - b_ref)) . (k_s exp(b_ref - b_s)), both factors
exp(<= 0), one matmul per sub-chunk; pairs inside a 16x16 diagonal block are formed exactly,
one key offset at a time. Decays down to g = -20 per token stay finite.
"""
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention._pallas_common import F32, iota

C = 64
SUB = 16
N_SUB = C // SUB


def masked_exp(x):
    return jnp.exp(jnp.minimum(x, 0.0))


def dot(a, b, cd=F32, trans_a=False, trans_b=False):
    """a @ b with fp32 accumulation. cd=F32 keeps full fp32 precision (not TF32): used where
    rounding would be amplified (the triangular inverse, the state); bf16 operands elsewhere."""
    dims = (((0,) if trans_a else (1,)), ((1,) if trans_b else (0,)))
    precision = jax.lax.Precision.HIGHEST if cd == F32 else None
    return jax.lax.dot_general(a.astype(cd), b.astype(cd), (dims, ((), ())),
                               precision=precision, preferred_element_type=F32)


def load(ref, start=None, n=None):
    """A ref (or rows [start, start + n) of it) as fp32."""
    return (ref[...] if start is None else ref[pl.ds(start, n)]).astype(F32)


def load_cols(ref, j, width):
    """Columns [j * width, (j + 1) * width) of a 2-D ref as fp32 (Dv blocks keep dot
    operands within shared memory at D = 256)."""
    return ref[:, pl.ds(j * width, width)].astype(F32)


def chunk_runs(r_ref, base):
    """Run indices of the chunk's tokens, of the token before it (0 before the first chunk)
    and of its last token. Run indices are non-decreasing, so the last is the max."""
    r = r_ref[pl.ds(base, C)]
    before = r_ref[pl.ds(jnp.maximum(base - 1, 0), 1)]
    prev = jnp.where(base > 0, jnp.max(before), 0)
    return r, prev, jnp.max(r)


def same_run(r):
    return r[:, None] == r[None, :]


def _layout():
    rows = iota(C, 0, (C, 1))
    return rows, jax.lax.div(rows, SUB), iota(C, 1, (C, C))


def _diag_rows(ref, j, blk):
    """[C, D]: row t holds row blk(t) * SUB + j of ref (the j-th token of t's sub-chunk)."""
    out = None
    for i in range(N_SUB):
        row = jnp.where(blk == i, load(ref, i * SUB + j, 1), 0.0)
        out = row if out is None else out + row
    return out


def _diag_ok(rows, blk, j, strict):
    offset = rows - blk * SUB
    return offset > j if strict else offset >= j


def _off_diag_factors(i, x, k, b, b_ref, rows, blk):
    ref = load(b_ref, i * SUB - 1, 1)  # b at the end of sub-chunk i - 1
    ex, ek = masked_exp(b - ref), masked_exp(ref - b)
    xf = jnp.where(blk == i, x * ex, 0.0)          # queries of sub-chunk i
    kf = jnp.where(rows < i * SUB, k * ek, 0.0)    # keys before it
    return xf, kf, ex, ek


def scores(x, k, b, k_ref, b_ref, same, strict, cd):
    """[C, C] decayed scores of queries x against keys k for s < t (s <= t unless strict)
    within one run (`same`), else 0. k_ref/b_ref: the chunk's keys and cumulative decays."""
    rows, blk, cols = _layout()
    a = jnp.zeros((C, C), F32)
    for i in range(1, N_SUB):
        xf, kf, _, _ = _off_diag_factors(i, x, k, b, b_ref, rows, blk)
        a += dot(xf, kf, cd, trans_b=True)

    def diag(j, a):
        kj, bj = _diag_rows(k_ref, j, blk), _diag_rows(b_ref, j, blk)
        e = jnp.where(_diag_ok(rows, blk, j, strict), masked_exp(b - bj), 0.0)
        col = jnp.sum(x * kj * e, axis=1, keepdims=True)
        return a + jnp.where(cols == blk * SUB + j, col, 0.0)

    a = jax.lax.fori_loop(0, SUB, diag, a)
    return jnp.where(same, a, 0.0)


def scores_bwd(da, x, k, b, k_ref, b_ref, strict, cd):
    """Cotangents (dx, dk) of `scores` given dA (zero outside `same`). The caller adds
    x * dx - k * dk to the cotangent of b."""
    rows, blk, cols = _layout()
    dx = jnp.zeros(x.shape, F32)
    dk = jnp.zeros(k.shape, F32)
    for i in range(1, N_SUB):
        xf, kf, ex, ek = _off_diag_factors(i, x, k, b, b_ref, rows, blk)
        da_i = jnp.where(blk == i, da, 0.0)
        dx += dot(da_i, kf, cd) * ex
        dk += jnp.where(rows < i * SUB, dot(da_i, xf, cd, trans_a=True) * ek, 0.0)

    def diag(j, acc):
        dx, dk = acc
        kj, bj = _diag_rows(k_ref, j, blk), _diag_rows(b_ref, j, blk)
        e = jnp.where(_diag_ok(rows, blk, j, strict), masked_exp(b - bj), 0.0)
        da_col = jnp.sum(jnp.where(cols == blk * SUB + j, da, 0.0), axis=1, keepdims=True)
        dx += da_col * kj * e
        to_key = da_col * x * e  # belongs to key blk(t) * SUB + j: sum within each sub-chunk
        for i in range(N_SUB):
            part = jnp.sum(jnp.where(blk == i, to_key, 0.0), axis=0, keepdims=True)
            dk += jnp.where(rows == i * SUB + j, part, 0.0)
        return dx, dk

    return jax.lax.fori_loop(0, SUB, diag, (dx, dk))


def unit_lower_inverse(m):
    """(I + m)^-1 for a strictly lower-triangular [C, C] m, by forward substitution in fp32:
    row t of the inverse is e_t - m[t, :] @ inv, whose rows s < t are already final."""
    rows, _, cols = _layout()
    eye = jnp.where(rows == cols, 1.0, 0.0)

    def step(t, inv):
        m_t = jnp.sum(jnp.where(rows == t, m, 0.0), axis=0)
        new = -jnp.sum(m_t[:, None] * inv, axis=0)
        return jnp.where(rows == t, new[None, :] + eye, inv)

    return jax.lax.fori_loop(1, C, step, eye)
