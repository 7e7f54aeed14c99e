"""Grouped matmul on one GPU: correctness, then TFLOP/s next to XLA and a dense matmul.

    PYTHONPATH=src:. python3 experiments/bench_grouped_matmul.py [--json out.json]

Shape: M=65536 routed token rows, K=7168, N=4096 (an expert's gate+up projection), 14
experts, bf16. Forward and input gradient (dout @ rhs[g]^T), balanced and skewed group
sizes, next to `jax.lax.ragged_dot` and one dense matmul of the same FLOPs; then the
rank-16 grouped LoRA product and a small sweep of the Mosaic kernel's tile settings.

    ... --quantized [--sweep-quantized | --sweep-only] [--formats F,...] [--json out.json]

times instead the matmul against packed frozen weights (pallas_kernels.quantized_matmul:
fp8_block, mxfp4, int4, dequantized tile by tile) next to the bf16 Mosaic grouped matmul
on the dequantized weights, forward and input gradient, on the shape above and Kimi K3's
expert shapes (gate+up K=3584, N=6144; down K=3072, N=3584), with the weight bytes each
reads. --sweep-quantized also tries the kernel's tile settings and dequantization variants
per format and orientation (on the first shape) and reports the best; --sweep-only runs
just the sweep, --formats fp8_block,int4 limits either to some formats. --smoke runs the quantized path at tiny shapes (on CPU: the loop
stand-in and the interpreted kernel), to check the script itself.

Figures on their own come from `experiments.timing.median_ms`; every ratio (against
dense, XLA's ragged_dot, the ragged_dot LoRA reference) from
`experiments.timing.interleaved_ratios`: both sides in alternating rounds of this run.
"""

import argparse
import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np

from experiments.timing import interleaved_ratios, median_ms
from pallas_kernels.grouped_matmul import (grouped_lora, grouped_lora_reference, grouped_matmul,
                                           grouped_matmul_reference)
from pallas_kernels.grouped_matmul.grouped_matmul import zero_rows_past_groups
from pallas_kernels.grouped_matmul.mosaic_kernel import mosaic_ragged_dot

M, K, N, G, RANK = 65536, 7168, 4096, 14, 16


def large_copies(fn, *args, min_elements):
  """Shapes of the copies XLA kept in the compiled program (a copy of the output would
    cost a read and a write of it)."""
  text = jax.jit(fn).lower(*args).compile().as_text()
  shapes = re.findall(r"= (\w+\[[\d,]+\])\{[^}]*\} copy\(", text)
  return [
      s for s in shapes if np.prod([int(d) for d in re.findall(r"\d+",
                                                               s.split("[")[1])]) >= min_elements
  ]


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def group_sizes(kind):
  m, g = M, G
  if kind == "balanced":
    sizes = np.full(g, m // g)
  else:  # skewed: Zipf-like 1/(i+1), one expert gets ~30% of the rows
    weights = 1.0 / np.arange(1, g + 1)
    sizes = np.floor(weights / weights.sum() * m).astype(np.int64)
  sizes[-1] += m - sizes.sum()
  return jnp.asarray(sizes, jnp.int32)


def check_small_shapes(report):
  """GPU path vs the ragged_dot reference on awkward shapes (padding, empty groups)."""
  keys = jax.random.split(jax.random.key(0), 3)
  m, k, n = 1000, 512, 384
  gs = jnp.array([0, 300, 0, 411, 200], jnp.int32)  # 911 rows; 89 past the groups
  lhs = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
  rhs = (jax.random.normal(keys[1], (5, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
  cot = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
  loss = lambda f: (lambda l, r: jnp.sum((f(l, r, gs) * cot).astype(jnp.float32)))
  out = jax.jit(grouped_matmul)(lhs, rhs, gs)
  report["small_fwd_rel_err"] = rel_err(out, grouped_matmul_reference(lhs, rhs, gs))
  report["small_rows_past_groups_zero"] = bool(jnp.all(out[911:] == 0))
  got = jax.jit(jax.grad(loss(grouped_matmul), argnums=(0, 1)))(lhs, rhs)
  want = jax.jit(jax.grad(loss(grouped_matmul_reference), argnums=(0, 1)))(lhs, rhs)
  report["small_dlhs_rel_err"] = rel_err(got[0], want[0])
  report["small_drhs_rel_err"] = rel_err(got[1], want[1])


def bench_shape(report, kind, lhs, rhs, dout, dense_w):
  gs = group_sizes(kind)
  tflop = 2 * M * K * N / 1e12
  tf = lambda ms: float(f"{tflop / (ms / 1e3):.4g}")
  r = report[kind] = {"group_sizes": gs.tolist()}
  fwd = jax.jit(grouped_matmul)
  raw_fwd = jax.jit(lambda l, w, g: mosaic_ragged_dot(l, w, g))
  raw_dlhs = jax.jit(lambda d, w, g: mosaic_ragged_dot(d, w, g, transpose_rhs=True))
  dlhs = jax.jit(
      lambda d, w, g: zero_rows_past_groups(mosaic_ragged_dot(d, w, g, transpose_rhs=True), g))
  xla = jax.jit(jax.lax.ragged_dot)
  xla_dlhs = jax.jit(lambda d, w, g: jax.lax.ragged_dot(d, jnp.swapaxes(w, 1, 2), g))
  out = fwd(lhs, rhs, gs)
  r["fwd_rel_err_vs_ragged_dot"] = rel_err(out, xla(lhs, rhs, gs))
  r["dlhs_rel_err_vs_ragged_dot"] = rel_err(dlhs(dout, rhs, gs), xla_dlhs(dout, rhs, gs))
  r["fwd_tflops"] = tf(median_ms(fwd, lhs, rhs, gs))
  r["fwd_kernel_only_tflops"] = tf(median_ms(raw_fwd, lhs, rhs, gs))
  r["dlhs_tflops"] = tf(median_ms(dlhs, dout, rhs, gs))
  r["dlhs_kernel_only_tflops"] = tf(median_ms(raw_dlhs, dout, rhs, gs))
  # Next to XLA's ragged_dot, in alternating rounds (it is ~12x slower: one call a round).
  for name, ours, theirs, x in (("fwd", fwd, xla, lhs), ("dlhs", dlhs, xla_dlhs, dout)):
    vs = r[f"{name}_vs_xla_ragged_dot_interleaved"] = interleaved_ratios({"public": ours}, theirs,
                                                                         x, rhs, gs, rounds=5,
                                                                         calls=1)
    r[f"xla_ragged_dot_{name}_tflops"] = tf(vs["baseline_ms"])
    r[f"{name}_vs_xla_ragged_dot"] = round(vs["public"]["median"], 1)
  # One MoE training step's use: forward + input gradient (frozen weights), end to end,
  # in alternating rounds with the dense matmul of the same FLOPs.
  step = jax.jit(
      jax.grad(lambda l, w, g: jnp.sum((grouped_matmul(l, w, g) * dout).astype(jnp.float32))))
  dense_step = jax.jit(jax.grad(lambda l, w: jnp.sum(((l @ w) * dout).astype(jnp.float32))))
  both = r["fwd_plus_dlhs_vs_dense_interleaved"] = interleaved_ratios(
      {"grouped": lambda: step(lhs, rhs, gs)}, lambda: dense_step(lhs, dense_w))
  r["fwd_plus_dlhs_ms"] = round(both["grouped"]["ms"], 3)
  r["dense_fwd_plus_dlhs_ms"] = round(both["baseline_ms"], 3)
  # The public input gradient exactly as the model takes it (the vjp in lhs), timed
  # interleaved with the dense matmul so the ratio is free of run-to-run drift.
  public_dlhs = lambda d, w, g: jax.vjp(lambda l: grouped_matmul(l, w, g), lhs)[1](d)[0]
  r["dlhs_copies_in_compiled_program"] = large_copies(public_dlhs, dout, rhs, gs,
                                                      min_elements=M * N)
  dense_dlhs = jax.jit(lambda d, w, g: d @ w[0].T)
  r["dlhs_vs_dense_interleaved"] = interleaved_ratios(
      {
          "public": jax.jit(public_dlhs),
          "kernel_only": raw_dlhs
      }, dense_dlhs, dout, rhs, gs)
  dense_fwd = jax.jit(lambda l, w, g: l @ w[0])
  r["fwd_vs_dense_interleaved"] = interleaved_ratios({
      "public": fwd,
      "kernel_only": raw_fwd
  }, dense_fwd, lhs, rhs, gs)
  # Fractions of dense from those rounds (not from the separately timed figures above).
  r["fwd_vs_dense"] = r["fwd_vs_dense_interleaved"]["public"]["median"]
  r["dlhs_vs_dense"] = r["dlhs_vs_dense_interleaved"]["public"]["median"]


def bench_lora(report, lhs):
  keys = jax.random.split(jax.random.key(2), 3)
  a = (jax.random.normal(keys[0], (G, K, RANK), jnp.float32) / np.sqrt(K)).astype(jnp.bfloat16)
  b = (jax.random.normal(keys[1], (G, RANK, N), jnp.float32) * 0.1).astype(jnp.bfloat16)
  gs = group_sizes("skewed")
  r = report["lora_rank16"] = {}
  ours = jax.jit(lambda x, a, b: grouped_lora(x, a, b, gs, 2.0))
  ref = jax.jit(lambda x, a, b: grouped_lora_reference(x, a, b, gs, 2.0))
  r["fwd_rel_err_vs_reference"] = rel_err(ours(lhs, a, b), ref(lhs, a, b))
  fwd = r["fwd_vs_reference_interleaved"] = interleaved_ratios({"grouped_lora": ours}, ref, lhs, a,
                                                               b, rounds=5, calls=2)
  r["fwd_ms"] = round(fwd["grouped_lora"]["ms"], 3)
  r["ragged_dot_reference_fwd_ms"] = round(fwd["baseline_ms"], 3)
  cot = jax.random.normal(keys[2], (M, N), jnp.bfloat16)
  grads = lambda f: jax.jit(
      jax.grad(lambda x, a, b: jnp.sum(
          (f(x, a, b, gs, 2.0) * cot).astype(jnp.float32)), argnums=(0, 1, 2)))
  both = r["fwd_bwd_vs_reference_interleaved"] = interleaved_ratios(
      {"grouped_lora": grads(grouped_lora)}, grads(grouped_lora_reference), lhs, a, b, rounds=5,
      calls=2)
  r["fwd_bwd_dx_da_db_ms"] = round(both["grouped_lora"]["ms"], 3)
  r["ragged_dot_reference_fwd_bwd_ms"] = round(both["baseline_ms"], 3)


TILE_CONFIGS = [  # (block_m, block_n, block_k, pipeline stages, column tiles per snake step)
    (128, 128, 64, 4, 8),
    (128, 128, 64, 6, 8),
    (128, 128, 64, 4, 4),
    (64, 128, 64, 4, 8),
    (128, 128, 128, 3, 8),
    (128, 256, 64, 3, 4),
    (128, 128, 64, 5, 7),
    (128, 128, 64, 4, 14),
]


def sweep_tiles(report, lhs, rhs, dout):
  """Mosaic kernel alone, skewed groups: forward (lhs @ rhs) and input gradient
    (dout @ rhs^T, 56 column tiles of K=7168), per tile setting."""
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
  gs = group_sizes("skewed")
  tflop = 2 * M * K * N / 1e12
  for direction, x, transpose, cols in (("fwd", lhs, False, N), ("dlhs", dout, True, K)):
    r = report[f"tile_sweep_{direction}_tflops"] = {}
    for bm, bn, bk, stages, gbn in TILE_CONFIGS:
      if (cols // bn) % gbn:
        continue  # the snake's column group must divide the column tiles
      name = f"bm{bm}_bn{bn}_bk{bk}_s{stages}_g{gbn}"
      f = jax.jit(lambda l, w, g, bm=bm, bn=bn, bk=bk, s=stages, c=gbn, t=transpose: ragged_dot_mgpu
                  .ragged_dot(l, w, group_sizes=g, block_m=bm, block_n=bn, block_k=bk,
                              max_concurrent_steps=s, grid_block_n=c, transpose_rhs=t))
      try:
        r[name] = round(tflop / (median_ms(f, x, rhs, gs) / 1e3), 1)
      except Exception as e:  # a config that does not fit shared memory, say
        r[name] = f"failed: {type(e).__name__}: {str(e)[:120]}"
    print(json.dumps({direction: r}), flush=True)


# ---- matmuls against packed weights ------------------------------------------------------

QUANTIZED_FORMATS = ("fp8_block", "mxfp4", "int4")
# (name, K, N): the shape above, then Kimi K3's routed experts (latent 3584 -> 2 x 3072
# gate+up, 3072 -> 3584 down)
QUANTIZED_SHAPES = (("m65536_k7168_n4096", K, N), ("k3_gate_up", 3584, 6144), ("k3_down", 3072,
                                                                               3584))


def quantized_tile_configs(fmt_name):
  """The sweep's TileConfigs for one format: tile shapes crossed with the dequantization
    variants (kernel.py's module doc); bn and bk are the weight tile's [N, K] sides in both
    orientations (forward: bn output columns, bk contracted; input gradient: bn contracted,
    bk output columns). The float32 decode on a few shapes, as the baseline of the others."""
  from pallas_kernels.quantized_matmul.kernel import TileConfig
  if fmt_name == "fp8_block":  # inside one 128 x 128 scale block: the scale after the product
    inside = [(128, 128, 64, 8, 4),
              (128, 128, 128, 8, 3), (128, 64, 128, 8, 4), (256, 128, 64, 8, 3),
              (256, 128, 128, 8, 2), (256, 64, 128, 8, 3), (64, 128, 128, 4, 4)]
    across = [(128, 128, 256, 8, 3), (128, 256, 64, 8, 3)]
    return ([TileConfig(*t, dequant=d) for t in inside for d in ("bits", "f32")] +
            [TileConfig(*t) for t in across])
  shapes = [(128, 128, 128, 8, 3), (128, 64, 128, 8, 4), (128, 128, 256, 8, 3),
            (256, 128, 64, 8, 3), (256, 128, 128, 8, 3), (256, 64, 128, 8, 3),
            (256, 128, 128, 8, 2)]
  variants = [{}, {
      "halves": True
  }, {
      "gather_scales": True
  }, {
      "halves": True,
      "gather_scales": True
  }]
  baseline = [TileConfig(*t, dequant="f32") for t in ((128, 128, 128, 8, 3), (256, 128, 128, 8, 3))]
  return baseline + [TileConfig(*t, **v) for t in shapes for v in variants]


def random_packed(key, fmt_name, g, n, k):
  """Packed weights of about unit-variance products: random codes (every code equally
    likely) and scales near 1/sqrt(k) of the format's typical magnitude."""
  from pallas_kernels.quantized_matmul import formats
  fmt = formats.get(fmt_name)
  k1, k2 = jax.random.split(key)
  scales_shape = (g, *fmt.scales_shape(n, k))
  if fmt_name == "fp8_block":
    codes = (jax.random.normal(k1, (g, n, k), jnp.float32) * 64).astype(jnp.float8_e4m3fn)
    return codes, jnp.full(scales_shape, 1 / (64 * np.sqrt(k)), jnp.float32)
  codes = jax.random.bits(k1, (g, n, k // 2), jnp.uint8)
  if fmt_name == "mxfp4":  # e2m1 values have rms ~3: 2^-2 ... 2^-1 / sqrt(k) scales
    exponent = 127 - 2 - int(np.log2(np.sqrt(k)))
    scales = jax.random.randint(k2, scales_shape, exponent - 1, exponent + 1).astype(jnp.uint8)
    return codes, scales
  return codes, jnp.full(scales_shape, 0.2 / np.sqrt(k), jnp.bfloat16)


def quantized_group_sizes(m, g):
  weights = 1.0 / np.arange(1, g + 1)  # skewed as above: Zipf-like
  sizes = np.floor(weights / weights.sum() * m).astype(np.int64)
  sizes[-1] += m - sizes.sum()
  return jnp.asarray(sizes, jnp.int32)


def bench_quantized_shape(report, fmt_name, shape_name, m, k, n, g, rounds, calls):
  """One format on one shape: the public op (kernel on GPU) against the bf16 Mosaic
    grouped matmul on the dequantized weights, forward and input gradient, in
    alternating rounds."""
  from pallas_kernels.quantized_matmul import formats, quantized_grouped_matmul
  fmt = formats.get(fmt_name)
  keys = jax.random.split(jax.random.key(3), 3)
  codes, scales = jax.jit(random_packed, static_argnums=(1, 2, 3, 4))(keys[0], fmt_name, g, n, k)
  w = jnp.swapaxes(jax.jit(formats.dequantize, static_argnums=2)(codes, scales, fmt_name), 1, 2)
  lhs = jax.random.normal(keys[1], (m, k), jnp.bfloat16)
  dout = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
  gs = quantized_group_sizes(m, g)
  tflop = 2 * m * k * n / 1e12
  tf = lambda ms: float(f"{tflop / (ms / 1e3):.4g}")
  r = report.setdefault(shape_name, {"m_k_n_g": [m, k, n, g]}).setdefault(fmt_name, {})
  r["weight_bytes"] = g * fmt.nbytes(n, k)
  r["bf16_weight_bytes"] = g * n * k * 2
  fwd = jax.jit(lambda l, c, s, gs: quantized_grouped_matmul(l, c, s, gs, fmt=fmt_name))
  dlhs = jax.jit(lambda d, c, s, gs: jax.vjp(
      lambda l: quantized_grouped_matmul(l, c, s, gs, fmt=fmt_name), lhs)[1](d)[0])
  bf16_fwd = jax.jit(grouped_matmul)
  bf16_dlhs = jax.jit(lambda d, w, gs: jax.vjp(lambda l: grouped_matmul(l, w, gs), lhs)[1](d)[0])
  r["fwd_rel_err_vs_bf16"] = rel_err(fwd(lhs, codes, scales, gs), bf16_fwd(lhs, w, gs))
  r["dlhs_rel_err_vs_bf16"] = rel_err(dlhs(dout, codes, scales, gs), bf16_dlhs(dout, w, gs))
  for name, ours, theirs, x in (("fwd", fwd, bf16_fwd, lhs), ("dlhs", dlhs, bf16_dlhs, dout)):
    vs = r[f"{name}_vs_bf16_interleaved"] = interleaved_ratios(
        {"quantized": lambda: ours(x, codes, scales, gs)}, lambda: theirs(x, w, gs), rounds=rounds,
        calls=calls)
    r[f"{name}_tflops"] = tf(vs["quantized"]["ms"])
    r[f"bf16_{name}_tflops"] = tf(vs["baseline_ms"])
    r[f"{name}_vs_bf16"] = vs["quantized"]["median"]  # > 1: the packed weights are faster
  print(json.dumps({shape_name: {fmt_name: r}}), flush=True)


def sweep_quantized(report, m, k, n, g, fmt_names, smoke, interpret):
  """The kernel alone per tile setting, per format and orientation; the best of each."""
  from pallas_kernels.quantized_matmul.kernel import TileConfig, quantized_grouped_matmul_kernel
  keys = jax.random.split(jax.random.key(4), 3)
  lhs = jax.random.normal(keys[1], (m, k), jnp.bfloat16)
  dout = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
  gs = quantized_group_sizes(m, g)
  tflop = 2 * m * k * n / 1e12
  out = report["quantized_tile_sweep"] = {"m_k_n_g": [m, k, n, g]}
  for fmt_name in fmt_names:
    codes, scales = jax.jit(random_packed, static_argnums=(1, 2, 3, 4))(keys[0], fmt_name, g, n, k)
    configs = quantized_tile_configs(fmt_name)
    if smoke:  # every variant at one tiny tile
      configs = {
          dataclasses.replace(c, bm=32, bn=64, bk=64, num_warps=4, num_stages=1) for c in configs
      }
    for direction, x, transpose in (("fwd", lhs, False), ("dlhs", dout, True)):
      r = out.setdefault(fmt_name, {})[direction] = {}
      for config in configs:
        f = jax.jit(lambda x, c, s, gs, config=config, t=transpose: quantized_grouped_matmul_kernel(
            x, c, s, gs, fmt=fmt_name, transpose=t, config=config, interpret=interpret))
        try:
          r[config.name] = float(f"{tflop / (median_ms(f, x, codes, scales, gs) / 1e3):.4g}")
        except Exception as e:  # a config that does not fit shared memory or registers
          r[config.name] = f"failed: {type(e).__name__}: {str(e)[:120]}"
      timed = {c: t for c, t in r.items() if isinstance(t, float)}
      if timed:
        best = max(timed, key=timed.get)
        r["best"] = {"config": best, "tflops": timed[best]}
      print(json.dumps({fmt_name: {direction: r}}), flush=True)


def main_quantized(args):
  report = {"device": str(jax.devices()[0]), "jax": jax.__version__, "mode": "quantized"}
  on_gpu = jax.default_backend() == "gpu"
  if args.smoke:  # tiny shapes: checks the script, not the kernel's speed
    shapes, m, g, rounds, calls = (("smoke", 256, 128),), 160, 3, 2, 1
  else:
    shapes, m, g, rounds, calls = QUANTIZED_SHAPES, M, G, 15, 5
  report["kernel"] = "pallas_triton" if on_gpu else "loop_over_groups (not a GPU)"
  fmt_names = args.formats.split(",")
  for name in fmt_names:
    if name not in QUANTIZED_FORMATS:
      raise SystemExit(f"--formats: unknown format {name!r}; known: {','.join(QUANTIZED_FORMATS)}")
  if not args.sweep_only:
    for shape_name, k, n in shapes:
      for fmt_name in fmt_names:
        bench_quantized_shape(report, fmt_name, shape_name, m, k, n, g, rounds, calls)
  if args.sweep_quantized or args.sweep_only:
    _, k, n = shapes[0]
    sweep_quantized(report, m, k, n, g, fmt_names, args.smoke, interpret=not on_gpu)
  print(json.dumps(report, indent=1))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1)


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--json", default=None)
  parser.add_argument("--no-sweep", action="store_true", help="skip the tile sweep")
  parser.add_argument("--quantized", action="store_true",
                      help="packed weights (fp8_block, mxfp4, int4) against bf16 instead")
  parser.add_argument("--sweep-quantized", action="store_true",
                      help="with --quantized: sweep the packed-weight kernel's tile settings")
  parser.add_argument("--sweep-only", action="store_true",
                      help="with --quantized: only the tile sweep (implies --sweep-quantized)")
  parser.add_argument("--formats", default=",".join(QUANTIZED_FORMATS),
                      help="with --quantized: comma-separated packed formats to time")
  parser.add_argument("--smoke", action="store_true",
                      help="with --quantized: tiny shapes, to check the script (runs on CPU)")
  args = parser.parse_args()
  if args.quantized or args.sweep_quantized or args.sweep_only or args.smoke:
    main_quantized(args)
    return
  report = {"device": str(jax.devices()[0]), "shape": [M, K, N, G], "jax": jax.__version__}
  check_small_shapes(report)
  print(json.dumps(report), flush=True)
  keys = jax.random.split(jax.random.key(1), 3)
  lhs = jax.random.normal(keys[0], (M, K), jnp.bfloat16)
  rhs = (jax.random.normal(keys[1], (G, K, N), jnp.float32) / np.sqrt(K)).astype(jnp.bfloat16)
  dout = jax.random.normal(keys[2], (M, N), jnp.bfloat16)
  dense_w = rhs[0]
  tflop = 2 * M * K * N / 1e12
  report["dense_same_flops"] = {
      "fwd_tflops":
          float(f"{tflop / (median_ms(jax.jit(jnp.matmul), lhs, dense_w) / 1e3):.4g}"),
      "dlhs_tflops":
          float(f"{tflop / (median_ms(jax.jit(lambda d, w: d @ w.T), dout, dense_w) / 1e3):.4g}"),
  }
  for kind in ("balanced", "skewed"):
    bench_shape(report, kind, lhs, rhs, dout, dense_w)
    print(json.dumps(report[kind]), flush=True)
  bench_lora(report, lhs)
  print(json.dumps(report["lora_rank16"]), flush=True)
  if not args.no_sweep:
    sweep_tiles(report, lhs, rhs, dout)
  print(json.dumps(report, indent=1))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1)


if __name__ == "__main__":
  main()
