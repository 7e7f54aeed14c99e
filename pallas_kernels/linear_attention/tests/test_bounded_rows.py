"""The key-gradient kernels give the same gradients whatever rows a loop step of a
bounded chunk covers (one step for the whole chunk, or one per sub-chunk)."""
import functools

import chex
import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.linear_attention import _chunk_prep
from pallas_kernels.linear_attention._chunk_cumsum import chunk_cumsum
from pallas_kernels.linear_attention._gla_chunks import chunk_key_grads as gla_key_grads
from pallas_kernels.linear_attention._inputs import CHUNK
from pallas_kernels.linear_attention._kda_key_grads import chunk_key_grads as kda_key_grads
from pallas_kernels.linear_attention.tests._data import bounded_chunks


def _operands(B=1, T=2 * CHUNK, H=1, D=16):
  ks = iter(jax.random.split(jax.random.key(3), 12))
  tokens = lambda: jax.random.normal(next(ks), (B, T, H, D))
  g = -2.0 * jax.random.uniform(next(ks), (B, T, H, D))**4
  assert bool(bounded_chunks(g).all())
  runs = jnp.cumsum(jax.random.uniform(next(ks), (B, T)) < 0.03, axis=1).astype(jnp.int32)
  n = T // CHUNK
  states = lambda: jax.random.normal(next(ks), (B, H, n, D, D))
  # score gradients [query, key]: zero above the diagonal (strictly below for A_kk's)
  da = jnp.tril(jax.random.normal(next(ks), (B, H, n, CHUNK, CHUNK)))
  return dict(q=tokens(), k=tokens(), v=tokens(), b=chunk_cumsum(g),
              masks=_chunk_prep.segment_masks(runs), h=states(), ds=states(), do=tokens(), da=da,
              dat=jnp.swapaxes(da, -1, -2), da_strict=jnp.tril(da, -1),
              beta=jax.random.uniform(next(ks), (B, T, H)))


def _gla(x, rows):
  return gla_key_grads(x["q"], x["k"], x["v"], x["b"], *x["masks"], x["h"], x["ds"], x["do"],
                       x["da"], x["dat"], scale=0.25, block_k=16, interpret=True, bounded_rows=rows)


def _kda(x, rows):
  return kda_key_grads(x["q"], x["k"], x["b"], x["beta"], *x["masks"], x["h"], x["ds"], x["do"],
                       x["v"], x["do"] * 0.5, x["da"], x["da_strict"], scale=0.25, block_k=16,
                       block_v=16, cd=jnp.float32, interpret=True, bounded_rows=rows)


@pytest.mark.parametrize("kernel", [_gla, _kda], ids=["gla", "kda"])
def test_rows_per_step_do_not_change_the_gradients(kernel):
  x = _operands()
  by_sub_chunk = jax.jit(functools.partial(kernel, rows=16))(x)
  for rows in (32, CHUNK):
    chex.assert_trees_all_close(
        jax.jit(functools.partial(kernel, rows=rows))(x), by_sub_chunk, rtol=1e-5, atol=1e-5)
