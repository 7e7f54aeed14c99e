"""Cross-entropy over a language-model head without the [N, V] logits.

Tokens are streamed in chunks of `token_chunk` (a `lax.scan`), each split into blocks of
`logits_chunk` tokens (an inner scan): a block's fp32 logits against the whole
vocabulary live only inside its step, and only its bf16 logit gradient is kept for the
chunk's two gradient matmuls. Because the loss is a scalar,
the gradient is computed in the same pass (d hidden per chunk, and d lm_head accumulated
over chunks only when lm_head is perturbed, via symbolic zeros), so the backward pass
is just a scale by the incoming cotangent: no second pass recomputes the logits.

Memory: about (2 * token_chunk + 4 * logits_chunk) * V bytes of temporaries (bf16 logit
gradient of a chunk + fp32 logits of a block; measured: docs/kernel_tuning.md,
"Cross-entropy temporaries"), plus, when lm_head is differentiated, its gradient [D, V]
accumulated in lm_head's dtype (bf16 accumulation across chunks, as Liger does; a float32
lm_head accumulates in float32). All matmuls run in the inputs' dtype with fp32
accumulation.
"""

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from .input_checks import check_cross_entropy_inputs
from .token_chunk_math import chunk_logit_gradient, chunk_logits, chunk_loss_terms

DEFAULT_TOKEN_CHUNK = 1024
DEFAULT_LOGITS_CHUNK = 512


def _chunk_sizes(n: int, token_chunk: int, logits_chunk: int):
  """(tokens per gradient matmul, tokens per fp32 logits block), shrunk for small N."""
  sub = min(logits_chunk, token_chunk)
  if token_chunk % sub:
    raise ValueError(f"token_chunk={token_chunk} must be a multiple of "
                     f"logits_chunk={logits_chunk}")
  chunk = min(token_chunk, -(-n // sub) * sub)
  return chunk, sub


def _split(hidden, labels, chunk: int, sub: int, ignore_index: int):
  """Pad N to a multiple of chunk (padded labels are ignored) and split into
    [chunks, sub-chunks per chunk, sub, ...]."""
  n = hidden.shape[0]
  padded = -(-n // chunk) * chunk
  if padded != n:
    hidden = jnp.pad(hidden, ((0, padded - n), (0, 0)))
    labels = jnp.pad(labels, (0, padded - n), constant_values=ignore_index)
  shape = (padded // chunk, chunk // sub, sub)
  return hidden.reshape(*shape, -1), labels.reshape(shape)


def _scan_loss_and_grads(hidden, lm_head, labels, *, ignore_index, z_loss, token_chunk,
                         logits_chunk, want_dhidden, want_dlm_head):
  n = hidden.shape[0]
  chunk, sub = _chunk_sizes(n, token_chunk, logits_chunk)
  hidden_chunks, label_chunks = _split(hidden, labels, chunk, sub, ignore_index)
  want_logit_grad = want_dhidden or want_dlm_head

  def logits_block(totals, block):
    # One fp32 [sub, V] logits block: its loss, and its logit gradient in bf16.
    h, y = block
    logits = chunk_logits(h, lm_head)
    per_token, lse, valid, safe_labels = chunk_loss_terms(logits, y, ignore_index, z_loss)
    totals = (totals[0] + jnp.sum(per_token), totals[1] + jnp.sum(valid, dtype=jnp.int32))
    dlogits = None
    if want_logit_grad:
      dlogits = chunk_logit_gradient(logits, lse, valid, safe_labels, z_loss, lm_head.dtype)
    return totals, dlogits

  def token_chunk_step(carry, chunk_inputs):
    loss_sum, count, dlm_head = carry
    h, y = chunk_inputs
    (loss_sum, count), dlogits = jax.lax.scan(logits_block, (loss_sum, count), (h, y))
    dh = None
    if want_logit_grad:
      # The gradient matmuls see the whole chunk: fewer, larger products, and
      # fewer read-modify-writes of the d lm_head accumulator.
      dlogits = dlogits.reshape(chunk, -1)
      h = h.reshape(chunk, -1)
      if want_dhidden:
        dh = jnp.dot(dlogits, lm_head.T, preferred_element_type=jnp.float32).astype(hidden.dtype)
      if want_dlm_head:
        dlm_head = dlm_head + jnp.dot(h.T.astype(lm_head.dtype), dlogits,
                                      preferred_element_type=lm_head.dtype)
    return (loss_sum, count, dlm_head), dh

  init_dlm_head = jnp.zeros_like(lm_head) if want_dlm_head else None
  init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32), init_dlm_head)
  (loss_sum, count, dlm_head), dh_chunks = jax.lax.scan(token_chunk_step, init,
                                                        (hidden_chunks, label_chunks))
  dhidden = dh_chunks.reshape(-1, hidden.shape[1])[:n] if want_dhidden else None
  return loss_sum, count, dhidden, dlm_head


@functools.lru_cache(maxsize=None)
def _differentiable_loss(ignore_index: int, z_loss: float, token_chunk: int, logits_chunk: int):
  options = dict(ignore_index=ignore_index, z_loss=z_loss, token_chunk=token_chunk,
                 logits_chunk=logits_chunk)

  @jax.custom_vjp
  def loss(hidden, lm_head, labels):
    loss_sum, count, _, _ = _scan_loss_and_grads(hidden, lm_head, labels, want_dhidden=False,
                                                 want_dlm_head=False, **options)
    return loss_sum, count

  def forward(hidden, lm_head, labels):
    loss_sum, count, dhidden, dlm_head = _scan_loss_and_grads(hidden.value, lm_head.value,
                                                              labels.value,
                                                              want_dhidden=hidden.perturbed,
                                                              want_dlm_head=lm_head.perturbed,
                                                              **options)
    return (loss_sum, count), (dhidden, dlm_head)

  def backward(saved, cotangents):
    dhidden, dlm_head = saved
    g_loss, _ = cotangents
    if isinstance(g_loss, SymbolicZero):
      return None, None, None
    scale = lambda d: None if d is None else (g_loss * d).astype(d.dtype)
    return scale(dhidden), scale(dlm_head), None

  loss.defvjp(forward, backward, symbolic_zeros=True)
  return loss


def chunked_cross_entropy(hidden, lm_head, labels, *, ignore_index=-100, z_loss=0.0,
                          token_chunk=DEFAULT_TOKEN_CHUNK, logits_chunk=DEFAULT_LOGITS_CHUNK):
  """hidden [N, D], lm_head [D, V], labels [N] -> (loss_sum fp32, valid_count int32).

    Same values and gradients as `cross_entropy_reference`; never holds [N, V] logits.
    token_chunk: tokens per gradient matmul (bf16 logit gradient [token_chunk, V]);
    logits_chunk: tokens per fp32 logits block (a divisor of token_chunk).
    Temporaries ~ (2 * token_chunk + 4 * logits_chunk) * V bytes.
    """
  check_cross_entropy_inputs(hidden, lm_head, labels, ignore_index)
  for name, value in (("token_chunk", token_chunk), ("logits_chunk", logits_chunk)):
    if not (isinstance(value, int) and value > 0):
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  _chunk_sizes(hidden.shape[0], token_chunk, logits_chunk)
  loss = _differentiable_loss(int(ignore_index), float(z_loss), token_chunk, logits_chunk)
  return loss(hidden, lm_head, labels.astype(jnp.int32))
