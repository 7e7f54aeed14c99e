"""Cross-entropy over a language-model head, streamed over token chunks.

    chunked_cross_entropy(hidden [N, D], lm_head [D, V], labels [N], *,
                          ignore_index=-100, z_loss=0.0, token_chunk=1024, logits_chunk=512)
        -> (loss_sum fp32, valid_count int32)

An XLA-chunked implementation (`lax.scan` + `jax.custom_vjp`), see
chunked_cross_entropy.py; `cross_entropy_reference` is the naive ground truth.
"""

from .chunked_cross_entropy import chunked_cross_entropy
from .reference import cross_entropy_reference

__all__ = ["chunked_cross_entropy", "cross_entropy_reference"]
