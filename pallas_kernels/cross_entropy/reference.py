"""Naive cross-entropy over a language-model head: materialises the [N, V] fp32 logits.

    loss_i = logsumexp(logits_i) - logits_i[label_i] + z_loss * logsumexp(logits_i)^2
for every token whose label is not ignore_index; returns (sum of loss_i, number of such
tokens). The tests treat this (and its autodiff gradients) as ground truth.
"""

import jax
import jax.numpy as jnp

from .input_checks import check_cross_entropy_inputs


def cross_entropy_reference(hidden, lm_head, labels, *, ignore_index=-100, z_loss=0.0):
  """hidden [N, D], lm_head [D, V], labels [N] -> (loss_sum fp32, valid_count int32)."""
  check_cross_entropy_inputs(hidden, lm_head, labels, ignore_index)
  logits = jnp.dot(hidden, lm_head, preferred_element_type=jnp.float32)
  valid = labels != ignore_index
  safe_labels = jnp.where(valid, labels, 0)
  lse = jax.nn.logsumexp(logits, axis=-1)
  label_logits = jnp.take_along_axis(logits, safe_labels[:, None], axis=-1)[:, 0]
  per_token = lse - label_logits + z_loss * jnp.square(lse)
  loss_sum = jnp.sum(jnp.where(valid, per_token, 0.0))
  return loss_sum, jnp.sum(valid, dtype=jnp.int32)
