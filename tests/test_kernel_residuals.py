"""The attention kernels' residuals carry the "attention" save-point name, so a remat
policy that keeps "attention" keeps what their backward reads (no second forward)."""

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import print_saved_residuals

from hylora.core import save_points
from pallas_kernels.linear_attention import chunked_gla, chunked_kda
from pallas_kernels.sparse_attention import sparse_attention
from pallas_kernels.sparse_attention.masked_dense import masked_dense_attention

B, T, H, D = 1, 128, 2, 64
KEEP_ATTENTION = jax.checkpoint_policies.save_only_these_names(save_points.ATTENTION)


def _inputs():
  keys = jax.random.split(jax.random.key(0), 5)
  q, k, v = (jax.random.normal(key, (B, T, H, D), jnp.bfloat16) for key in keys[:3])
  g = -jax.nn.softplus(jax.random.normal(keys[3], (B, T, H, D)))
  beta = jax.nn.sigmoid(jax.random.normal(keys[4], (B, T, H)))
  return q, k, v, g, beta


def _causal_indices(top_k=16):
  idx = jnp.broadcast_to(jnp.arange(top_k, dtype=jnp.int32), (B, T, top_k))
  return jnp.where(idx <= jnp.arange(T)[None, :, None], idx, -1)


CASES = {
    # KDA: qg, kg, w, v_new [B, T, H, D]; A_qk, (I + A_kk)^-1 [B, H, T/64, 64, 64]; states
    "kda": (lambda q, k, v, g, beta: chunked_kda(q, k, v, g, beta)[0], {
        (B, T, H, D): 4,
        (B, H, T // 64, 64, 64): 3
    }),
    "gla": (lambda q, k, v, g, beta: chunked_gla(q, k, v, g)[0], {
        (B, H, T // 64, 64, 64): 1
    }),
    "sparse": (lambda q, k, v, g, beta: sparse_attention(q, k, v, _causal_indices()), {
        (B, T, H, D): 1
    }),
    # fused dense attention under the selection mask: its own residuals (on CPU, XLA's
    # attention: output, probabilities [B, HK, G, T, T], the mask)
    "masked_dense": (lambda q, k, v, g, beta: masked_dense_attention(q, k, v, _causal_indices()), {
        (B, T, H, D): 1,
        (B, 1, H, T, T): 2
    }),
}


def _saved(fn, capsys) -> list[str]:
  """JAX's own list of what a checkpointed function keeps for its backward, one line each
  ("bf16[1,128,2,64] named 'attention' from ...")."""
  capsys.readouterr()
  print_saved_residuals(fn, *_inputs())
  return capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("kernel", sorted(CASES))
def test_residuals_are_saved_under_the_attention_name(kernel, capsys):
  fn, expected = CASES[kernel]
  loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32))
  named = [
      line.split()[0]
      for line in _saved(jax.checkpoint(loss, policy=KEEP_ATTENTION), capsys)
      if f"named '{save_points.ATTENTION}'" in line
  ]
  for shape, count in expected.items():
    text = f"[{','.join(map(str, shape))}]"
    assert sum(s.endswith(text) for s in named) >= count, (kernel, named)
  nothing = jax.checkpoint(loss, policy=jax.checkpoint_policies.nothing_saveable)
  assert not [line for line in _saved(nothing, capsys) if "named" in line]
