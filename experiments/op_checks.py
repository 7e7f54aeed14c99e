"""What `experiments.check_ops` runs for each registered op: inputs at two sizes and the
declared tolerances.

Every op of `hylora.ops.catalog` gets an `OpCheck` in `CHECKS`. `make_inputs(key, size)`
builds the op's arguments in the dtypes the model feeds it: size "small" runs in seconds
on CPU (Pallas kernels interpreted), size "bench" is the `gpu-1` preset's shape of the op
(one H200). The pipeline compares each implementation with the reference evaluated on
fp32 copies of the same inputs (the ground truth) by relative RMS error and by max error
(max |x - truth| / max |truth|), forward and backward.

Tolerances are for bf16 inputs/outputs: one bf16 rounding is 2^-9 relative (~0.2% RMS),
so 1% RMS forward and 2% backward leave room for a few roundings and fp32 reassociation,
and catch any real bug (a wrong mask, gate or gradient term is off by far more).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from typing import Callable

BF16, F32 = jnp.bfloat16, jnp.float32


@dataclasses.dataclass
class OpCheck:
  """How `experiments.check_ops` exercises an op.

  make_inputs(key, size) -> (args, kwargs) with size in {"small", "bench"}; the outputs
  compared are the op's outputs (pytree); gradients are taken with respect to
  `grad_argnums` of a random projection of the outputs. Tolerances bound the relative RMS
  error and the max error (max |x - truth| / max |truth|); index outputs can be compared
  as sets.
  """

  make_inputs: Callable[[jax.Array, str], tuple[tuple, dict]]
  grad_argnums: tuple[int, ...] = ()
  fwd_rtol: float = 5e-3
  bwd_rtol: float = 1e-2
  description: str = ""
  fwd_max_tol: float | None = None  # None: 4 x fwd_rtol
  bwd_max_tol: float | None = None  # None: 4 x bwd_rtol
  index_sets: bool = False  # integer outputs are sets along the last axis (order-free)


def max_tolerances(spec: OpCheck) -> tuple[float, float]:
  """(forward, backward) bounds on max |x - truth| / max |truth|."""
  fwd = spec.fwd_max_tol or 4 * spec.fwd_rtol
  bwd = spec.bwd_max_tol or 4 * spec.bwd_rtol
  return fwd, bwd


def _pick(size: str, small, bench):
  if size not in ("small", "bench"):
    raise ValueError(f"size must be 'small' or 'bench', got {size!r}")
  return small if size == "small" else bench


def _normal(key, shape, dtype=BF16):
  return jax.random.normal(key, shape, F32).astype(dtype)


def _segments(key, b: int, t: int, every: int):
  """Segment ids [B, T] with a boundary about every `every` tokens (packed documents)."""
  return jnp.cumsum(jax.random.uniform(key, (b, t)) < 1.0 / every, axis=1).astype(jnp.int32)


def _group_sizes(key, m: int, groups: int):
  """A random split of m rows into `groups` sorted groups (some may be empty)."""
  cuts = jnp.sort(jax.random.randint(key, (groups - 1,), 0, m + 1))
  return jnp.diff(jnp.concatenate([jnp.zeros(1, jnp.int32), cuts, jnp.full(1, m, jnp.int32)]))


# ---- linear attention ---------------------------------------------------------------


def _linear_attention_inputs(key, size: str, delta_rule: bool):
  b, t, h, d = _pick(size, (1, 128, 2, 16), (1, 8192, 64, 128))
  ks = jax.random.split(key, 6)
  q, k, v = (_normal(ks[i], (b, t, h, d)) for i in range(3))
  # Mostly mild decays with a heavy tail down to the gate floor (-20), as the model makes.
  g = -20.0 * jax.random.uniform(ks[3], (b, t, h, d))**4
  kwargs = {"segment_ids": _segments(ks[4], b, t, every=48)}
  if delta_rule:
    beta = jax.nn.sigmoid(jax.random.normal(ks[5], (b, t, h)))
    # the KDA layers pass the gate projection and the decay's parameters (the released
    # initialisation, A in [1, 16]; f ~ N(0, 1): a tail of decays to about -12 a token)
    f, decay = _decay_gate(ks[3], b, t, h, d)
    return (q, k, v, f, beta), kwargs | {"decay": decay}
  return (q, k, v, g), kwargs


def _decay_gate(key, b, t, h, d):
  from pallas_kernels.linear_attention.decay_gate import DecayGate
  kf, kp = jax.random.split(key)
  return _normal(kf, (b, t, h, d)), DecayGate.drawn(kp, h, d)


GLA = OpCheck(lambda key, size: _linear_attention_inputs(key, size, False),
              grad_argnums=(0, 1, 2, 3), fwd_rtol=1e-2, bwd_rtol=2e-2,
              description="chunked GLA: bf16 q/k/v, fp32 log-decay gates, packed segments")
KDA = OpCheck(
    lambda key, size: _linear_attention_inputs(key, size, True), grad_argnums=(0, 1, 2, 3, 4),
    fwd_rtol=1e-2, bwd_rtol=2e-2,
    description="chunked KDA (delta rule): as GLA plus fp32 beta, the decay from "
    "a bf16 gate projection in the kernels (DecayGate)")

# ---- sparse attention ---------------------------------------------------------------


def _topk_inputs(key, size: str):
  b, t, hi, di, top_k = _pick(size, (1, 64, 2, 16, 16), (1, 8192, 64, 128, 2048))
  ks = jax.random.split(key, 4)
  # Small integers: every score is exact in fp32, so ties are real ties and every
  # implementation must break them the same way (smaller key index first).
  q_idx = jax.random.randint(ks[0], (b, t, hi, di), -2, 3).astype(BF16)
  k_idx = jax.random.randint(ks[1], (b, t, di), -2, 3).astype(BF16)
  w = jax.random.randint(ks[2], (b, t, hi), -1, 3).astype(F32)
  return (q_idx, k_idx, w), {"top_k": top_k, "segment_ids": _segments(ks[3], b, t, every=40)}


TOPK = OpCheck(_topk_inputs, grad_argnums=(), fwd_rtol=0.0, index_sets=True,
               description="indexer top-K: integer-valued scores (exact ties), packed segments")


def _attend_inputs(key, size: str):
  b, t, hq, hk, d, top_k = _pick(size, (1, 64, 4, 2, 16, 16), (1, 8192, 64, 8, 128, 2048))
  ks = jax.random.split(key, 4)
  q = _normal(ks[0], (b, t, hq, d))
  k, v = _normal(ks[1], (b, t, hk, d)), _normal(ks[2], (b, t, hk, d))
  # top_k distinct keys per query drawn from all positions; future keys become -1.
  perm = jax.vmap(lambda kk: jax.random.permutation(kk, t)[:top_k])(jax.random.split(
      ks[3], b * t)).reshape(b, t, top_k)
  indices = jnp.where(perm <= jnp.arange(t)[None, :, None], perm, -1).astype(jnp.int32)
  return (q, k, v, indices), {}


ATTEND = OpCheck(_attend_inputs, grad_argnums=(0, 1, 2), fwd_rtol=1e-2, bwd_rtol=2e-2,
                 description="GQA softmax attention over selected keys (bf16)")


def _causal_inputs(key, size: str):
  # MLA's shapes: query/key head dim nope + rope, a narrower value head dim
  b, t, h, dk, dv = _pick(size, (1, 64, 2, 24, 16), (1, 8192, 64, 192, 128))
  ks = jax.random.split(key, 4)
  q, k = _normal(ks[0], (b, t, h, dk)), _normal(ks[1], (b, t, h, dk))
  v = _normal(ks[2], (b, t, h, dv))
  kwargs = {"segment_ids": _segments(ks[3], b, t, every=40), "block_q": _pick(size, 16, 64)}
  return (q, k, v), kwargs


CAUSAL = OpCheck(
    _causal_inputs, grad_argnums=(0, 1, 2), fwd_rtol=1e-2, bwd_rtol=2e-2,
    description="causal softmax attention, packed segments, value head dim "
    "below the key's (bf16)")

# ---- grouped matmuls (MoE experts) --------------------------------------------------


def _grouped_matmul_inputs(key, size: str):
  m, k, n, groups = _pick(size, (64, 32, 48, 4), (16384, 7168, 4096, 32))
  ks = jax.random.split(key, 3)
  lhs = _normal(ks[0], (m, k))
  rhs = (_normal(ks[1], (groups, k, n), F32) * k**-0.5).astype(BF16)
  return (lhs, rhs, _group_sizes(ks[2], m, groups)), {}


GROUPED_MATMUL = OpCheck(_grouped_matmul_inputs, grad_argnums=(0, 1), fwd_rtol=1e-2, bwd_rtol=2e-2,
                         description="ragged (per-expert) matmul, bf16")


def _grouped_lora_inputs(key, size: str):
  m, k, r, n, groups = _pick(size, (64, 32, 4, 32, 4), (16384, 7168, 16, 4096, 32))
  ks = jax.random.split(key, 4)
  x = _normal(ks[0], (m, k))
  a = (_normal(ks[1], (groups, k, r), F32) * k**-0.5).astype(BF16)
  b_ = (_normal(ks[2], (groups, r, n), F32) * r**-0.5).astype(BF16)
  return (x, a, b_, _group_sizes(ks[3], m, groups), 2.0), {}


GROUPED_LORA = OpCheck(_grouped_lora_inputs, grad_argnums=(0, 1, 2), fwd_rtol=1e-2, bwd_rtol=2e-2,
                       description="per-expert LoRA scale * (x A_g) B_g, bf16")


def _packed(key, shape, fmt: str):
  """Random packed weights [..., N, K] of `fmt` (codes, scales), about unit-normal / sqrt(K)."""
  from pallas_kernels.quantized_matmul.formats import random_codes
  return random_codes(key, shape, fmt, shape[-1]**-0.5)


def _quantized_grouped_matmul_inputs(key, size: str):
  # Kimi K3's routed experts (MXFP4): the latent 3584 -> gate/up 2 x 3072
  m, k, n, groups = _pick(size, (64, 64, 48, 4), (16384, 3584, 6144, 14))
  ks = jax.random.split(key, 3)
  codes, scales = _packed(ks[1], (groups, n, k), "mxfp4")
  return (_normal(ks[0], (m, k)), codes, scales, _group_sizes(ks[2], m, groups)), {"fmt": "mxfp4"}


QUANTIZED_GROUPED_MATMUL = OpCheck(
    _quantized_grouped_matmul_inputs, grad_argnums=(0,), fwd_rtol=1e-2, bwd_rtol=2e-2,
    description="per-expert matmul against MXFP4-packed frozen weights (input gradient only)")


def _quantized_matmul_inputs(key, size: str):
  # a DeepSeek-V3.2 attention projection (FP8, 128 x 128 block scales): q_b 1536 -> 24576;
  # small: edges that do not fill a scale block
  b, t, k, n = _pick(size, (2, 16, 160, 72), (1, 8192, 1536, 24576))
  ks = jax.random.split(key, 2)
  codes, scales = _packed(ks[1], (n, k), "fp8_block")
  return (_normal(ks[0], (b, t, k)), codes, scales), {"fmt": "fp8_block"}


QUANTIZED_MATMUL = OpCheck(
    _quantized_matmul_inputs, grad_argnums=(0,), fwd_rtol=1e-2, bwd_rtol=2e-2,
    description="a linear against an FP8 block-scaled frozen weight (input gradient only)")

# ---- loss and norms -----------------------------------------------------------------


def _cross_entropy_inputs(key, size: str):
  # small: N > 1024 so the chunked implementation runs more than one token chunk
  n, d, v = _pick(size, (1300, 32, 320), (8192, 7168, 163840))
  ks = jax.random.split(key, 4)
  hidden = _normal(ks[0], (n, d))
  lm_head = (_normal(ks[1], (d, v), F32) * d**-0.5).astype(BF16)
  labels = jax.random.randint(ks[2], (n,), 0, v)
  labels = jnp.where(jax.random.uniform(ks[3], (n,)) < 0.1, -100, labels)  # masked tokens
  return (hidden, lm_head, labels), {"ignore_index": -100}


CROSS_ENTROPY = OpCheck(_cross_entropy_inputs, grad_argnums=(0, 1), fwd_rtol=1e-3, bwd_rtol=2e-2,
                        description="LM-head cross-entropy, 10% ignored labels")


def _rms_norm_inputs(key, size: str):
  shape = _pick(size, (2, 64, 32), (1, 8192, 7168))
  ks = jax.random.split(key, 2)
  weight = 1.0 + 0.1 * jax.random.normal(ks[1], shape[-1:], F32)
  return (_normal(ks[0], shape), weight), {"eps": 1e-6}


RMS_NORM = OpCheck(_rms_norm_inputs, grad_argnums=(0, 1), fwd_rtol=1e-2, bwd_rtol=2e-2,
                   description="RMSNorm, bf16 in/out, fp32 math")


def _residual_mix_inputs(key, size: str):
  b, t, d, window = _pick(size, (2, 64, 32, 2), (1, 8192, 7168, 2))
  ks = jax.random.split(key, 3)
  weights = jnp.array([1.0] + [0.0] * window, F32) + 0.3 * jax.random.normal(ks[2], (window + 1,))
  return (_normal(ks[0], (b, t, d)), _normal(ks[1], (window, b, t, d)), weights), {}


RESIDUAL_MIX = OpCheck(
    _residual_mix_inputs, grad_argnums=(0, 1, 2), fwd_rtol=1e-2, bwd_rtol=2e-2,
    description="learned mix of the stream and earlier "
    "layers' outputs (docs/day_one.md)")


def _short_conv_inputs(key, size: str):
  b, t, h, d, taps = _pick(size, (2, 128, 2, 32, 4), (1, 32768, 32, 128, 4))
  ks = jax.random.split(key, 3)
  w = taps**-0.5 * jax.random.normal(ks[1], (h, d, taps), F32)
  return (_normal(ks[0], (b, t, h, d)), w), {
      "segment_ids": _segments(ks[2], b, t, every=40),
      "normalize": True
  }


SHORT_CONV = OpCheck(
    _short_conv_inputs, grad_argnums=(0, 1), fwd_rtol=1e-2, bwd_rtol=2e-2,
    description="the delta rule's q / k prologue: short causal conv, SiLU, per-head L2 norm")

CHECKS = {
    "linear_attention.gla": GLA,
    "linear_attention.kda": KDA,
    "sparse_attention.topk_indices": TOPK,
    "sparse_attention.attend": ATTEND,
    "attention.causal": CAUSAL,
    "grouped_matmul": GROUPED_MATMUL,
    "grouped_lora": GROUPED_LORA,
    "quantized_grouped_matmul": QUANTIZED_GROUPED_MATMUL,
    "quantized_matmul": QUANTIZED_MATMUL,
    "cross_entropy": CROSS_ENTROPY,
    "rms_norm": RMS_NORM,
    "residual_mix": RESIDUAL_MIX,
    "short_conv": SHORT_CONV,
}
"""The check of every op defined in the catalog, by op name."""
