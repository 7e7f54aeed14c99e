"""The looped in-chunk KDA kernel against the unrolled one (interpret mode on CPU): the
same outputs, inverse included, on fresh random inputs with segment resets; log decays
g >= -2 per token send the first chunk's diagonal blocks down the factored path, g = -20
on some tokens of the second chunk sends its blocks down the exact one."""
import jax.numpy as jnp
import pytest

from pallas_kernels.linear_attention import _chunk_prep
from pallas_kernels.linear_attention._kda_intra import chunk_intra
from pallas_kernels.linear_attention._kda_intra_rows import chunk_intra_rows
from pallas_kernels.linear_attention.tests._data import fast_jit, make_inputs, rel_rms, with_strong_decay

NAMES = ("qg", "kg", "w", "u0", "A_qk", "inverse")


def _intra_inputs(seed, T, D, dtype, segment_rate):
    x = make_inputs(seed=seed, T=T, H=2, Dk=D, Dv=D, dtype=dtype, segment_rate=segment_rate,
                    min_log_decay=-2.0)
    t = jnp.arange(T)
    x = with_strong_decay(x, (t >= 66) & (t < 128) & (t % 4 == 0))
    B = x["q"].shape[0]
    q, k, v, b, runs = _chunk_prep.prepare(x["q"], x["k"], x["v"], x["g"], x["segment_ids"],
                                           B, T)
    beta = jnp.pad(x["beta"], ((0, 0), (0, q.shape[1] - T), (0, 0)))
    return (q, k, v, b, beta, runs, *_chunk_prep.segment_masks(runs))


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_rows_kernel_matches_the_unrolled_kernel(dtype, tol):
    args = _intra_inputs(seed=11, T=144, D=32, dtype=dtype, segment_rate=0.05)
    kw = dict(cd=dtype, emit_inverse=True, interpret=True)
    want = fast_jit(lambda *a: chunk_intra(*a, **kw))(*args)
    got = fast_jit(lambda *a: chunk_intra_rows(*a, **kw))(*args)
    for name, a, b in zip(NAMES, want, got):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel_rms(a, b) < tol, (name, rel_rms(a, b))


def test_rows_kernel_without_the_inverse():
    args = _intra_inputs(seed=12, T=64, D=16, dtype=jnp.float32, segment_rate=0.0)
    kw = dict(cd=jnp.float32, emit_inverse=False, interpret=True)
    want = fast_jit(lambda *a: chunk_intra(*a, **kw))(*args)
    got = fast_jit(lambda *a: chunk_intra_rows(*a, **kw))(*args)
    assert len(got) == 5
    for name, a, b in zip(NAMES, want, got):
        assert rel_rms(a, b) < 1e-5, name
