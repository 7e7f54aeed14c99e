"""GPU benchmark: Pallas chunked GLA vs the plain-JAX chunked reference (same run).

    PYTHONPATH=src:. python3 experiments/bench_linear_attention.py [--peers]

Prints forward and forward+backward milliseconds (median of timed calls after warm-up),
a correctness check against the reference, and (with --peers) the jla / fla figures from
.device/peers.py at the anchor shape.
"""
import argparse
import json
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

from pallas_kernels.linear_attention import chunked_gla, gla_chunked

SHAPES = [(1, 32768, 32, 128), (2, 16384, 16, 128), (1, 8192, 96, 128), (1, 1048576, 8, 128)]
REFERENCE_SKIP = {(1, 1048576, 8, 128): "reference skipped: its fwd+bwd alone would take seconds per call"}


def inputs(B, T, H, D, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q, k, v = (jax.random.normal(kk, (B, T, H, D), jnp.bfloat16) for kk in ks[:3])
    g = jax.nn.log_sigmoid(jax.random.normal(ks[3], (B, T, H, D), jnp.float32))
    return q, k, v, g


def timed(f, *args, n=10):
    for _ in range(2):
        jax.block_until_ready(f(*args))
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def fwd_and_fwdbwd(fn):
    fwd = jax.jit(lambda q, k, v, g: fn(q, k, v, g)[0])
    loss = lambda q, k, v, g: fn(q, k, v, g)[0].astype(jnp.float32).sum()
    fwdbwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    return fwd, fwdbwd


def rel_rms(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.sqrt(jnp.mean((a - b) ** 2) / jnp.mean(a ** 2)))


def correctness(shape=(1, 4096, 4, 128)):
    q, k, v, g = inputs(*shape, seed=1)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    loss = lambda fn: lambda *a: jnp.sum(jnp.sin(fn(*a)[0].astype(jnp.float32)))
    o_ref = jax.jit(lambda *a: gla_chunked(*a)[0])(*f32, g)
    o = jax.jit(lambda *a: chunked_gla(*a)[0])(q, k, v, g)
    g_ref = jax.jit(jax.grad(loss(gla_chunked), (0, 1, 2, 3)))(*f32, g)
    g_pal = jax.jit(jax.grad(loss(chunked_gla), (0, 1, 2, 3)))(q, k, v, g)
    errs = {"o": rel_rms(o_ref, o)} | {f"d{n}": rel_rms(a, b) for n, a, b in zip("qkvg", g_ref, g_pal)}
    print(json.dumps({"correctness_vs_fp32_reference": list(shape), "rel_rms": errs}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--peers", action="store_true")
    ap.add_argument("--block-v", type=int, nargs="*", default=[64])
    args = ap.parse_args()
    print(jax.devices(), flush=True)
    correctness()
    for shape in SHAPES:
        row = {"shape": list(shape)}
        q, k, v, g = inputs(*shape)
        for bv in args.block_v:
            fwd, fwdbwd = fwd_and_fwdbwd(lambda *a, bv=bv: chunked_gla(*a, block_v=bv))
            row[f"pallas_bv{bv}_fwd_ms"] = round(timed(fwd, q, k, v, g), 3)
            row[f"pallas_bv{bv}_fwdbwd_ms"] = round(timed(fwdbwd, q, k, v, g), 3)
        if shape in REFERENCE_SKIP:
            row["reference"] = REFERENCE_SKIP[shape]
        else:
            fwd, fwdbwd = fwd_and_fwdbwd(gla_chunked)
            row["reference_fwd_ms"] = round(timed(fwd, q, k, v, g, n=3), 3)
            row["reference_fwdbwd_ms"] = round(timed(fwdbwd, q, k, v, g, n=3), 3)
        print(json.dumps(row), flush=True)
        del q, k, v, g
    if args.peers:
        shape = ",".join(map(str, SHAPES[0]))
        subprocess.run([sys.executable, ".device/peers.py", "linear_attention", "--shape", shape])


if __name__ == "__main__":
    main()
