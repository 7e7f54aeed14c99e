"""Chunked cross-entropy on one GPU: time and temporary memory next to the naive loss.

    PYTHONPATH=src:. python3 experiments/bench_cross_entropy.py [--json out.json]

Shape: N=8192 tokens, d=7168, V=163840, bf16. The naive loss forms the [N, V] logits
with a bf16 matmul, upcasts them to fp32 and differentiates through XLA (the common
baseline; its temporaries are the bf16 and fp32 logits). Gradient wrt hidden (frozen
lm_head, the LoRA case) and wrt both, for a few token-chunk sizes.
"""

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cross_entropy import chunked_cross_entropy

N, D, V = 8192, 7168, 163840


def median_ms(fn, *args, reps=5):
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def naive_loss(hidden, lm_head, labels):
    logits = (hidden @ lm_head).astype(jnp.float32)
    valid = labels != -100
    safe = jnp.where(valid, labels, 0)
    per_token = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, safe[:, None], -1)[:, 0]
    return jnp.sum(jnp.where(valid, per_token, 0.0))


def measure(fn, argnums, args):
    """Compile grad(fn) once: (temp GB, median ms, gradients)."""
    compiled = jax.jit(jax.grad(fn, argnums=argnums)).lower(*args).compile()
    temp_gb = compiled.memory_analysis().temp_size_in_bytes / 1e9
    ms = median_ms(compiled, *args)
    return round(temp_gb, 3), round(ms, 2), compiled(*args)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    parser.add_argument("--chunks", default="1024:256,1024:512,2048:256",
                        help="token_chunk:logits_chunk pairs")
    args = parser.parse_args()
    keys = jax.random.split(jax.random.key(0), 4)
    hidden = jax.random.normal(keys[0], (N, D), jnp.bfloat16)
    lm_head = (jax.random.normal(keys[1], (D, V), jnp.float32) * 0.02).astype(jnp.bfloat16)
    labels = jax.random.randint(keys[2], (N,), 0, V)
    labels = jnp.where(jax.random.uniform(keys[3], (N,)) < 0.05, -100, labels)
    inputs = (hidden, lm_head, labels)
    report = {"device": str(jax.devices()[0]), "shape": [N, D, V], "jax": jax.__version__}
    for wrt, argnums in (("hidden", 0), ("both", (0, 1))):
        temp, ms, naive_grads = measure(naive_loss, argnums, inputs)
        report[f"naive_grad_{wrt}"] = {"temp_GB": temp, "ms": ms}
        print(json.dumps({wrt: report[f"naive_grad_{wrt}"]}), flush=True)
        for chunk in args.chunks.split(","):
            tc, lc = map(int, chunk.split(":"))
            fn = lambda h, w, y, tc=tc, lc=lc: chunked_cross_entropy(
                h, w, y, token_chunk=tc, logits_chunk=lc)[0]
            temp_c, ms_c, grads = measure(fn, argnums, inputs)
            pairs = zip(grads, naive_grads) if wrt == "both" else [(grads, naive_grads)]
            entry = {"temp_GB": temp_c, "ms": ms_c,
                     "temp_vs_naive": round(temp_c / temp, 4), "time_vs_naive": round(ms_c / ms, 3),
                     "grad_rel_err_vs_naive": [round(rel_err(g, w), 5) for g, w in pairs]}
            report[f"chunked{tc}_{lc}_grad_{wrt}"] = entry
            print(json.dumps({f"chunked{tc}_{lc}_{wrt}": entry}), flush=True)
    loss_naive = jax.jit(naive_loss)(*inputs)
    loss_chunked = jax.jit(lambda *a: chunked_cross_entropy(*a)[0])(*inputs)
    report["loss_rel_err_vs_naive"] = abs(float(loss_chunked) / float(loss_naive) - 1)
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
