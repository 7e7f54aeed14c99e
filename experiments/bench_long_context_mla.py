"""GPU benchmark: one device's share of MLA's full attention on a sequence split over
devices (`hylora.model.mixers.latent_attention_split`), against cuDNN's flash attention on
the same queries and keys with K and V materialised.

    PYTHONPATH=src:. python3 experiments/bench_long_context_mla.py [--keys 1048576]
        [--local 8192] [--heads 96] [--baseline-keys 131072]
    PYTHONPATH=src:. python3 experiments/bench_long_context_mla.py --interpret

Kimi K3's shapes (96 heads, kv_rank 512, query/key dims nope 128 + rope 64 (not rotated
in K3), v 128; LoRA rank 16 on kv_b_proj), bf16. Each device gathers the compressed latent of all --keys keys and
attends for --local queries, up-projecting one key block at a time. Two shares: the
last device's own range (every key causal: the most work without balancing) and the
balanced one (half-blocks 0 and 2P - 1, the work every device then has). Forward +
backward (the gradients of q, the latent and the adapter), timed by
`experiments.timing.median_ms`, with the matmul FLOPs the share really does (scores and
values over its causal keys, the up-projection of those keys, each twice more in the
backward) as TFLOP/s. Then, at --baseline-keys (K and V of every key must fit beside
cuDNN's workspace), the last share against cuDNN on the same queries and keys in
alternating rounds (`interleaved_ratios`: > 1, the split path is faster). One JSON row per
measurement. --interpret: tiny shapes on the CPU (no cuDNN; a check that it runs).
"""
import argparse
import json

import jax
import jax.numpy as jnp
from flax import nnx

from experiments.timing import interleaved_ratios, median_ms
from hylora.core.config import LoRAConfig
from hylora.model.init import ParamInit
from hylora.model.lora import Linear
from hylora.model.mixers.latent_attention_split import attention_over_gathered_keys
from meshes import logical_axes as ax

FULL = dict(keys=1 << 20, local=8192, heads=96, kv_rank=512, nope=128, rope=64, v=128, block_k=256)
TINY = dict(keys=256, local=32, heads=2, kv_rank=16, nope=8, rope=4, v=8, block_k=16)


def _problem(s, keys):
  ks = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(ks[0], (1, s["local"], s["heads"], s["nope"] + s["rope"]), jnp.bfloat16)
  latent = jax.random.normal(ks[1], (1, keys, s["kv_rank"] + s["rope"]), jnp.bfloat16)
  proj = Linear((s["kv_rank"],), (s["heads"], s["nope"] + s["v"]), (ax.LOW_RANK,),
                (ax.HEADS, ax.HEAD_DIM), name="kv_b_proj",
                lora=LoRAConfig(rank=16, alpha=32.0,
                                targets=("kv_b_proj",)), init=ParamInit(0), init_std=0.02)
  graph, weights = nnx.split(proj)
  # B factors start at zero: shift the adapter so every factor has a gradient path
  weights = jax.tree.map(lambda w: w + 0.01 if w.dtype == jnp.float32 else w, weights)
  return q, latent, graph, weights


def _share(s, graph, offsets):
  """fn(q, latent, weights) -> o for the queries at `offsets` (equal parts of q)."""
  up = lambda weights, latent, key: nnx.merge(graph, weights)(latent, key)
  scale = (s["nope"] + s["rope"])**-0.5

  def fn(q, latent_and_rope, weights):
    parts = jnp.split(q, len(offsets), axis=1)
    latent, rope = latent_and_rope[..., :s["kv_rank"]], latent_and_rope[..., s["kv_rank"]:]
    seg_k = jnp.zeros(latent.shape[:2], jnp.int32)
    outs = [
        attention_over_gathered_keys(up, weights, None, part, latent, rope,
                                     jnp.zeros(part.shape[:2], jnp.int32), seg_k, offset,
                                     nope_dim=s["nope"], scale=scale, block_k=s["block_k"])
        for part, offset in zip(parts, offsets)
    ]
    return jnp.concatenate(outs, axis=1)

  return fn


def _fwdbwd(fn):
  loss = lambda q, latent, weights: fn(q, latent, weights).astype(jnp.float32).sum()
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _flops(s, offsets, part):
  """Matmul FLOPs of forward + backward: per query its causal keys' scores and values,
  per needed key block its up-projection (2 passes forward; the backward recomputes
  both and takes 2x each)."""
  h, width = s["heads"], s["nope"] + s["v"]
  causal = sum(part * off + part * (part + 1) // 2 for off in offsets)
  blocks = sum(-(-(off + part) // s["block_k"]) for off in offsets)
  attend = 2 * causal * h * (s["nope"] + s["rope"] + s["v"])
  up = 2 * blocks * s["block_k"] * s["kv_rank"] * h * width
  return 3 * (2 * attend + 2 * up)


def cudnn_baseline(s, keys):
  """cuDNN flash attention fwd+bwd of the last share (every key causal but the
  diagonal block), K and V up-projected once for every key; v zero-padded to the key
  width, as the unsplit MLA's cuDNN call pads it (pallas_kernels/causal_attention/cudnn.py)."""
  ks = jax.random.split(jax.random.key(1), 2)
  k = jax.random.normal(ks[0], (1, keys, s["heads"], s["nope"] + s["rope"]), jnp.bfloat16)
  v = jax.random.normal(ks[1], (1, keys, s["heads"], s["nope"] + s["rope"]), jnp.bfloat16)
  local = s["local"]
  # query i (at keys - local + i) sees keys <= its position: a bottom-right causal mask
  mask = (jnp.arange(keys)[None, :] <= (keys - local + jnp.arange(local))[:, None])

  def loss(q, k, v):
    o = jax.nn.dot_product_attention(q, k, v, mask=mask[None, None], implementation="cudnn")
    return o.astype(jnp.float32).sum()

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (k, v)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--keys", type=int, default=None)
  p.add_argument("--local", type=int, default=None)
  p.add_argument("--heads", type=int, default=None)
  p.add_argument("--baseline-keys", type=int, default=131072)
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--interpret", action="store_true", help="tiny shapes on the CPU")
  a = p.parse_args(argv)
  s = dict(TINY if a.interpret else FULL)
  for name in ("keys", "local", "heads"):
    if getattr(a, name) is not None:
      s[name] = getattr(a, name)
  if s["keys"] % s["local"] or s["local"] % 2:
    raise SystemExit(f"error: --keys {s['keys']} must be a multiple of --local {s['local']}, "
                     "and --local even")
  devices, half = s["keys"] // s["local"], s["local"] // 2
  shares = {"last": [s["keys"] - s["local"]], "balanced": [0, (2 * devices - 1) * half]}
  reps = 1 if a.interpret else a.reps
  q, latent, graph, weights = _problem(s, s["keys"])
  print(json.dumps(dict(device=str(jax.devices()[0]), devices=devices, **s)), flush=True)
  for name, offsets in shares.items():
    part = s["local"] // len(offsets)
    step = _fwdbwd(_share(s, graph, offsets))
    ms = median_ms(step, q, latent, weights, reps=reps)
    flops = _flops(s, offsets, part)
    print(
        json.dumps(
            dict(share=name, offsets=offsets, fwdbwd_ms=round(ms, 2),
                 tflops=round(flops / ms / 1e9, 1))), flush=True)
  if a.interpret:
    return
  keys = min(a.baseline_keys, s["keys"])
  q, latent, graph, weights = _problem(s, keys)
  ours = _fwdbwd(_share(s, graph, [keys - s["local"]]))
  theirs, (k, v) = cudnn_baseline(s, keys)
  r = interleaved_ratios({"split_mla": lambda: ours(q, latent, weights)}, lambda: theirs(q, k, v),
                         rounds=5, calls=1)
  print(json.dumps(dict(vs_cudnn_keys=keys, cudnn_ms=r["baseline_ms"], split_mla=r["split_mla"])),
        flush=True)


if __name__ == "__main__":
  main()
