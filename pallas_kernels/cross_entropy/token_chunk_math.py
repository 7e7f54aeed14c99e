"""Loss and logit gradient for one chunk of tokens against the whole vocabulary.

The chunk's logits [n, V] are the only vocabulary-sized buffer alive at a time: they
are formed in fp32 (bf16 matmul, fp32 accumulation), reduced to a per-token
log-sum-exp, and turned straight into d loss / d logits (in the weights' dtype).
"""

import jax.numpy as jnp


def chunk_logits(hidden_chunk, lm_head):
  return jnp.dot(hidden_chunk, lm_head, preferred_element_type=jnp.float32)


def chunk_loss_terms(logits, labels, ignore_index: int, z_loss: float):
  """-> (per-token loss [n] (0 where ignored), lse [n], valid [n], safe labels [n])."""
  valid = labels != ignore_index
  safe_labels = jnp.where(valid, labels, 0)
  row_max = jnp.max(logits, axis=-1)
  lse = row_max + jnp.log(jnp.sum(jnp.exp(logits - row_max[:, None]), axis=-1))
  label_logits = jnp.take_along_axis(logits, safe_labels[:, None], axis=-1)[:, 0]
  per_token = jnp.where(valid, lse - label_logits + z_loss * jnp.square(lse), 0.0)
  return per_token, lse, valid, safe_labels


def chunk_logit_gradient(logits, lse, valid, safe_labels, z_loss: float, dtype):
  """d(sum of per-token losses) / d logits = softmax * (1 + 2 z lse) - onehot(label)."""
  softmax_scale = jnp.where(valid, 1.0 + 2.0 * z_loss * lse, 0.0)
  probs = jnp.exp(logits - lse[:, None]) * softmax_scale[:, None]
  vocab_ids = jnp.arange(logits.shape[1], dtype=safe_labels.dtype)
  is_label = (vocab_ids[None, :] == safe_labels[:, None]) & valid[:, None]
  return (probs - is_label.astype(jnp.float32)).astype(dtype)
