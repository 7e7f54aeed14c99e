"""Bad shapes raise ValueError naming the argument."""
import jax.numpy as jnp
import pytest

from pallas_kernels.linear_attention import (chunked_gla, chunked_kda, gla_chunked, kda_chunked,
                                             kda_recurrent)
from pallas_kernels.linear_attention.gla import Tiling
from pallas_kernels.linear_attention.tests._data import make_inputs


@pytest.fixture(scope="module")
def x():
  return make_inputs(seed=0, T=8)


@pytest.mark.parametrize("fn", [gla_chunked, chunked_gla])
@pytest.mark.parametrize("name,bad,match", [
    ("k", jnp.zeros((1, 8, 2, 8)), "k has shape"),
    ("v", jnp.zeros((1, 7, 2, 16)), "v has shape"),
    ("g", jnp.zeros((1, 8, 16)), "g must be 4-D"),
])
def test_bad_positional(fn, x, name, bad, match):
  args = dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"])
  args[name] = bad
  with pytest.raises(ValueError, match=match):
    fn(args["q"], args["k"], args["v"], args["g"])


def test_bad_keywords(x):
  qkvg = (x["q"], x["k"], x["v"], x["g"])
  with pytest.raises(ValueError, match="initial_state has shape"):
    chunked_gla(*qkvg, initial_state=jnp.zeros((1, 2, 16, 8)))
  with pytest.raises(ValueError, match="segment_ids has shape"):
    gla_chunked(*qkvg, segment_ids=jnp.zeros((1, 9), jnp.int32))
  with pytest.raises(ValueError, match="segment_ids must be an integer"):
    gla_chunked(*qkvg, segment_ids=jnp.zeros((1, 8)))
  with pytest.raises(ValueError, match="beta has shape"):
    kda_chunked(*qkvg, jnp.zeros((1, 8, 3)))
  with pytest.raises(ValueError, match="beta has shape"):
    kda_recurrent(*qkvg, jnp.zeros((1, 8)))
  with pytest.raises(ValueError, match="power of two"):
    chunked_gla(x["q"][..., :12], x["k"][..., :12], x["v"], x["g"][..., :12])


def test_bad_kda_tiles(x):
  args = (x["q"], x["k"], x["v"], x["g"], x["beta"])  # Dk = Dv = 16
  with pytest.raises(ValueError, match="block_k = 24: need a power of two"):
    chunked_kda(*args, block_k=24)
  with pytest.raises(ValueError, match="block_v = 32: need a power of two >= 16 dividing"):
    chunked_kda(*args, block_v=32)


def test_bad_gla_tiles(x):
  args = (x["q"], x["k"], x["v"], x["g"])  # Dk = Dv = 16
  with pytest.raises(ValueError, match="block_k = 12: need a power of two"):
    chunked_gla(*args, tiling=Tiling(block_k=12))
  with pytest.raises(ValueError, match="forward_block_v = 'widest': expected a width or one of"):
    chunked_gla(*args, tiling=Tiling(forward_block_v="widest"))
  with pytest.raises(ValueError, match="forward_block_v = 12: need a power of two"):
    chunked_kda(*args, x["beta"], forward_block_v=12)
  with pytest.raises(ValueError, match="forward_block_v = None: expected a width or one of"):
    chunked_kda(*args, x["beta"], forward_block_v=None)


def test_forward_value_tiles_by_heads():
  """"by_heads": 32-wide tiles for at most 16 chains (batch rows x heads), 64 for at most 32,
    else 128, never wider than the head."""
  from pallas_kernels.linear_attention._mosaic_common import forward_value_tile
  assert [forward_value_tile("by_heads", 1, h, 128) for h in (8, 16, 17, 32, 33, 96)
         ] == [32, 32, 64, 64, 128, 128]
  assert forward_value_tile("by_heads", 2, 16, 128) == 64
  assert forward_value_tile("by_heads", 1, 96, 64) == 64
  assert forward_value_tile(128, 1, 4, 64) == 64
