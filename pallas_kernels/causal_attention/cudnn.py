"""Causal attention through cuDNN's fused flash attention (jax.nn.dot_product_attention).

cuDNN wants one head dim for q, k and v: the narrower side is zero-padded (zero value
columns give zero output columns, sliced off; zero query/key columns leave every dot
product unchanged), which is exact. Packed documents go in as jax.nn.dot_product_attention's
boolean mask [B, 1, T, T] of same-segment pairs (one byte per pair, plus the bias cuDNN
makes of it), beside its own causal mask, which lets the kernel skip the tiles past the
diagonal. Inputs cuDNN does not take (fp32, head dims it does not support) and other
backends run the plain-JAX reference instead.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import residuals
from pallas_kernels.causal_attention import input_checks
from pallas_kernels.causal_attention.reference import causal_attention_reference

FUSED_DTYPES = (jnp.bfloat16, jnp.float16)
MAX_HEAD_DIM = 256  # cuDNN's flash attention on Hopper


def cudnn_causal_attention(q, k, v, *, segment_ids=None, scale=None, block_q: int = 64):
  """Same contract as causal_attention_reference (block_q only matters to its fallback)."""
  input_checks.check_inputs(q, k, v, segment_ids, block_q)
  dk, dv = q.shape[-1], v.shape[-1]
  d = max(dk, dv)
  fused = (jax.default_backend() == "gpu" and q.dtype in FUSED_DTYPES and k.dtype == q.dtype and
           v.dtype == q.dtype and d % 8 == 0 and d <= MAX_HEAD_DIM)
  if not fused:
    return causal_attention_reference(q, k, v, segment_ids=segment_ids, scale=scale,
                                      block_q=block_q)
  scale = dk**-0.5 if scale is None else scale
  pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, d - x.shape[-1])))
  mask = None
  if segment_ids is not None:
    mask = (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
  o = _attention_keeping_residuals(pad(q), pad(k), pad(v), mask, scale)
  return o[..., :dv]


def _attention(q, k, v, mask, scale):
  return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=True,
                                      implementation="cudnn")


# jax's fused attention keeps its residuals (output, softmax statistics, the mask as a
# bias) unnamed, so inside the model's remat policies its forward would run again in the
# backward; this wrapper names them as the attention core's residuals
# (pallas_kernels/residuals.py).
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention_keeping_residuals(q, k, v, mask, scale):
  return _attention(q, k, v, mask, scale)


def _attention_fwd(q, k, v, mask, scale):
  o, pullback = jax.vjp(lambda q, k, v: _attention(q, k, v, mask, scale), q, k, v)
  return o, jax.tree.map(lambda a: residuals.keep(a)[0], pullback)


def _attention_bwd(scale, pullback, do):
  return (*pullback(do), None)


_attention_keeping_residuals.defvjp(_attention_fwd, _attention_bwd)
