"""Expert parallelism on the 8 GPUs of one host, per mesh: MoE transport bandwidth, the MoE
layer with and without chunked overlap, and a whole LoRA train step.

  python -m experiments.bench_multi_gpu                          # 8 GPUs: meshes 1x8 and 2x4
  python -m experiments.bench_multi_gpu --mesh 2x4 --json out.json
  python -m experiments.bench_multi_gpu --model.moe.capacity_factor=1.5   # any config field
  python -m experiments.bench_multi_gpu --small                  # 8 simulated CPU devices (CI)

The config: gpu-1 at the target's MoE shape (top-16, "ep_alltoall" dispatch, capacity
factor 1.25, 2 x 8192 tokens per GPU), then the overrides; per mesh, --mesh FSDPxEXPERT
sets mesh.fsdp / mesh.expert and model.moe.experts = --experts-per-rank (14) x expert.

1. The transports of hylora.model.ffn.expert_parallel, uniform random top_k routing:
   dispatch (row gather + all-to-all) and combine (all-to-all back), "padded" ([R, C, d]
   buffers) and "ragged" (the real rows; ragged_all_to_all, GPU/TPU only). GB/s per GPU
   = bytes one GPU hands to the collective / median time, next to a plain
   `jax.lax.all_to_all` of the padded buffer over the expert axis (NCCL's own).
2. The MoE FFN module forward + backward (input and LoRA gradients) per --chunks value
   of model.moe.overlap_chunks: ms, speed-up over the first, and whether output and
   gradients equal the first's (they must when no pair is dropped).
3. The compiled LoRA train step (bench_step.whole_step): tokens/s per GPU and MFU
   (bench_step.flops_per_step / devices against --peak).

--small: a one-layer tiny model on 8 simulated CPU devices, compiled at XLA's cheapest
level; timings mean nothing there, the run shows that every path works.

Every comparison comes from alternating rounds in this process
(`experiments.timing.interleaved_ratios`, --repeats rounds of one call each): each
transport against the plain all-to-all ("of_plain"), each chunk count (and its
profile-guided compile) against the first ("speedup").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

# None of these starts a JAX backend: --small can still ask for simulated devices in main.
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from experiments.bench_step import H200_BF16_PEAK, flops_per_step, whole_step
from experiments.timing import interleaved_ratios
from hylora.core.config import MeshConfig
from hylora.profile import hlo_schedule
from hylora.profile.pgle import compile_with_profile
from hylora.core.errors import ConfigError
from hylora.model.context import ForwardContext
from hylora.model.execution import Execution
from hylora.model.ffn import expert_parallel as ep
from hylora.model.ffn.moe import MoE
from hylora.model.init import ParamInit
from hylora.model.lora import LoRAParam
from hylora.train.mesh import run_mesh
from hylora.core.overrides import apply_overrides, split_overrides
from hylora.core.presets import gpu_1, tiny
from meshes.mesh import add_xla_flags, ensure_cpu_devices
from meshes.rules import ACTIVATION_RULES, activation_mesh, logical_to_spec, state_shardings

DEFAULTS = {
    "full": dict(experts_per_rank=14, chunks=[1, 2, 4], steps=5, repeats=10),
    "small": dict(experts_per_rank=2, chunks=[1, 2], steps=1, repeats=2)
}
SMALL_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
PARTS = ("transport", "moe_layer", "train_step")
TOLERANCE = 2e-2  # max |difference| / max |first|: bf16 sums taken in another order


def _args(argv):
  p = argparse.ArgumentParser(prog="python -m experiments.bench_multi_gpu",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--small", action="store_true", help="tiny shapes on 8 simulated CPU devices")
  p.add_argument("--mesh", nargs="+", default=["1x8", "2x4"], help="FSDPxEXPERT meshes")
  p.add_argument("--experts-per-rank", type=int, help="experts per EP rank (14; small 2)")
  p.add_argument("--chunks", type=int, nargs="+", help="overlap_chunks to time (1 2 4; small 1 2)")
  p.add_argument("--steps", type=int, help="timed train steps after the first (5; small 1)")
  p.add_argument("--repeats", type=int, help="timed runs per benchmark (10; small 2)")
  p.add_argument("--peak", type=float, default=H200_BF16_PEAK, help="peak FLOP/s per GPU")
  p.add_argument("--json", default=None, help="write the report here")
  p.add_argument(
      "--pgle", action="store_true",
      help="also time the MoE layer recompiled with its measured instruction "
      "profile (profile-guided scheduling; NVIDIA GPUs)")
  p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                 help="which benchmarks to run per mesh (all three by default)")
  p.add_argument(
      "--schedule-only", action="store_true",
      help="compile the MoE layer per --chunks and report which compute XLA "
      "scheduled under each asynchronous all-to-all; run nothing")
  p.add_argument("--hlo-dir", default=None, help="with --schedule-only: write the HLO here")
  p.add_argument(
      "--mock-gpus", type=int, default=0,
      help="with --schedule-only: compile for N GPUs on one (XLA's mock NCCL "
      "topology: 1 slice x N hosts x 1 GPU), so one GPU shows the 8-GPU schedule")
  overrides, rest = split_overrides(argv)
  args = p.parse_args(rest)
  for name, value in DEFAULTS["small" if args.small else "full"].items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  args.overrides = overrides
  return args


def _base(small: bool, devices: int):
  r = dataclasses.replace
  if small:  # tiny, cut to what compiles fast on CPU: one sparse-attention MoE layer, no
    # shared expert, no images, LoRA on the experts only; dropless: chunks change nothing
    cfg = tiny()
    moe = r(cfg.model.moe, dispatch="ep_alltoall", capacity_factor=0.0, shared_experts=0)
    model = r(cfg.model, layers=1, dense_layers=0, pattern=("sparse",), moe=moe,
              vision=r(cfg.model.vision, enabled=False))
    return r(cfg, preset="tiny-ep", model=model, lora=r(cfg.lora, targets=("gate_up",)),
             train=r(cfg.train, batch_size=devices, seq_len=64))
  cfg = gpu_1()
  moe = r(cfg.model.moe, top_k=16, dispatch="ep_alltoall", capacity_factor=1.25)
  return r(cfg, preset="gpu-1-ep", model=r(cfg.model, moe=moe),
           train=r(cfg.train, batch_size=2 * devices))  # 2 x 8192 tokens per GPU


def configs(args) -> dict:
  """{mesh name: (validated config, mesh)}; a ConfigError names the first bad input."""
  devices = jax.device_count()
  base, out = apply_overrides(_base(args.small, devices), args.overrides), {}
  for text in args.mesh:
    try:
      fsdp, expert = (int(v) for v in text.lower().split("x"))
    except ValueError:
      raise ConfigError(f"--mesh: {text!r} is not FSDPxEXPERT, e.g. 1x8") from None
    moe = dataclasses.replace(base.model.moe, experts=args.experts_per_rank * expert)
    cfg = dataclasses.replace(base, mesh=MeshConfig(fsdp=fsdp, expert=expert),
                              model=dataclasses.replace(base.model, moe=moe)).validate()
    mesh = run_mesh(cfg.mesh, jax.devices())  # every device; a bad shape is a ConfigError
    ep.check_transport(cfg.model.moe.transport, mesh)  # the layer's and the train step's
    tokens = cfg.train.batch_size * cfg.train.seq_len
    for c in args.chunks:
      if c < 1 or tokens % (devices * c):
        raise ConfigError(f"--chunks: the {tokens} tokens of a step do not split into "
                          f"{devices} devices x {c} chunks")
    out[f"{fsdp}x{expert}"] = cfg, mesh
  return out


def _smap(fn, mesh, options=None):
  """jit(shard_map(fn)), every argument and result split along dim 0 over all devices."""
  split = P(ep.TOKEN_AXES)
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=split, out_specs=split),
                 compiler_options=options)


def _routing(cfg, mesh):
  """x [tokens, d] and top_k distinct uniform random experts per token, split over devices."""
  n, moe = cfg.train.batch_size * cfg.train.seq_len, cfg.model.moe
  split = NamedSharding(mesh, P(ep.TOKEN_AXES))

  def make():
    kx, ks = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (n, cfg.model.d_model), jnp.bfloat16)
    slots = jnp.argsort(jax.random.uniform(ks, (n, moe.experts)), axis=1)[:, :moe.top_k]
    return x, slots.astype(jnp.int32)

  return jax.jit(make, out_shardings=(split, split))()


def _rate(nbytes, ms, plain=None):
  """ms, GB/s and, given the plain all-to-all's bytes and the median over alternating
  rounds of its time / this leg's, the fraction of its GB/s."""
  out = {"ms": round(ms, 4), "gbps": float(f"{nbytes / ms / 1e6:.4g}")}
  if plain:
    plain_bytes, ratio = plain
    out["of_plain"] = round(ratio * nbytes / plain_bytes, 3)
  return out


def bench_transports(cfg, mesh, repeats: int) -> dict:
  moe, devices, ranks = cfg.model.moe, mesh.size, mesh.shape[ep.EXPERT_AXIS]
  per_gpu = cfg.train.batch_size * cfg.train.seq_len // devices
  pairs, k = per_gpu * moe.top_k, moe.top_k
  cap = ep.capacity(pairs, ranks, moe.capacity_factor)
  x, slots = _routing(cfg, mesh)

  def plan(slots):  # the dispatcher's send plan and pair rows, and the rows each source
    per_rank = moe.experts // ranks  # rank sends here
    p = ep.plan_sends(slots.reshape(-1), ranks, per_rank, cap)
    rows = ep.pair_rows(slots.reshape(-1), p, cap, per_rank)
    sizes = jax.lax.all_to_all(p.kept, ep.EXPERT_AXIS, 0, 0, tiled=True).sum(1)
    return p._replace(dropped=p.dropped[None]), rows, sizes

  p, rows, sizes = _smap(plan, mesh)(slots)
  sent = (p, rows, sizes)
  pair_token = lambda x: jnp.arange(x.shape[0] * k, dtype=jnp.int32) // k
  legs = {
      "padded": (lambda x, p, r, s: ep._padded_out(x, pair_token(x), r, cap, ranks),
                 lambda y, p, r, s: ep._padded_back(y, p, cap, ranks)),
      "ragged": (lambda x, p, r, s: ep._ragged_out(x, pair_token(x), p, cap, ranks, s),
                 lambda y, p, r, s: ep._ragged_back(y, p, cap, ranks, s))
  }
  row = cfg.model.d_model * x.dtype.itemsize
  nbytes = {
      "padded": ranks * cap * row,  # the [R, C, d] buffer; ragged: the real rows
      "ragged": int(np.asarray(p.sent).sum()) * row // devices
  }
  out = {
      "ranks": ranks,
      "tokens_per_gpu": per_gpu,
      "pairs_per_gpu": pairs,
      "capacity": cap,
      "dropped_fraction": float(np.asarray(p.dropped).sum()) / (pairs * devices)
  }
  plain = _smap(lambda b: jax.lax.all_to_all(b, ep.EXPERT_AXIS, 0, 0, tiled=True), mesh)
  results = {}
  for name, (there, back) in legs.items():
    try:
      ep.check_transport(name, mesh)
    except ConfigError as e:  # ragged on XLA:CPU
      out[name] = {"skipped": str(e)}
      continue
    moe_as_run = dataclasses.replace(moe, transport=name)
    options = ep.xla_options(moe_as_run, mesh.devices.flat[0].platform)
    there, back = _smap(there, mesh, options), _smap(back, mesh, options)
    recv = there(x, *sent)
    results[name] = (recv, back(recv, *sent))
    if name == "padded":  # NCCL's own all-to-all of the same buffer: the baseline
      plain_input, plain_bytes = recv, nbytes[name]
    # Both legs and the plain all-to-all in alternating rounds, one call each a round.
    rounds = interleaved_ratios(
        {
            "dispatch": lambda: there(x, *sent),
            "combine": lambda: back(recv, *sent)
        }, lambda: plain(plain_input), rounds=repeats, calls=1)
    if name == "padded":
      out["all_to_all"] = {
          "bytes_per_gpu": plain_bytes,
          **_rate(plain_bytes, rounds["baseline_ms"])
      }
    out[name] = {
        "bytes_per_gpu": nbytes[name],
        **{
            leg: _rate(nbytes[name], rounds[leg]["ms"], (plain_bytes, rounds[leg]["median"])) for leg in ("dispatch", "combine")
        }
    }
  if "ragged" in results:  # both deliver the same [R * C, d] layout, zeros past the rows
    out["ragged"]["matches_padded"] = all(
        bool(jnp.array_equal(a, b)) for a, b in zip(results["ragged"], results["padded"]))
  return out


def _max_rel_diff(a, b) -> float:
  big = lambda v: float(jnp.max(jnp.abs(v.astype(jnp.float32))))
  return max(
      big(u.astype(jnp.float32) - v.astype(jnp.float32)) / max(big(v), 1e-30)
      for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _with_chunks(cfg, c):
  moe = dataclasses.replace(cfg.model.moe, overlap_chunks=c)
  return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe=moe))


def _layer_fwd_bwd(cfg, mesh):
  """jit(value_and_grad) of the MoE module in (lora, x, rest, probe): input and LoRA
  gradients, the output and the dropped-token count as aux."""
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: MoE(cfg.model, cfg.lora, init=ParamInit(0))))
  b, t = cfg.train.batch_size, cfg.train.seq_len

  def loss(lora, x, rest, probe):
    ctx = ForwardContext(jnp.ones((b, t), jnp.int32), jnp.zeros((b, t), jnp.int32),
                         execution=Execution(cfg.kernels, cfg.memory))
    y, aux = nnx.merge(graphdef, lora, rest)(x, ctx)
    return jnp.sum((y * probe).astype(jnp.float32)), (y, aux["dropped_tokens"])

  def run(*args):
    with activation_mesh(mesh):
      return jax.value_and_grad(loss, (0, 1), has_aux=True)(*args)

  return jax.jit(run)


def _layer_shardings(cfg, mesh):
  abstract = nnx.eval_shape(lambda: MoE(cfg.model, cfg.lora, init=ParamInit(0)))
  params = [state_shardings(s, mesh) for s in nnx.split(abstract, LoRAParam, ...)[1:]]
  b, t = cfg.train.batch_size, cfg.train.seq_len
  spec = logical_to_spec(("batch", "seq"), (b, t), mesh, ACTIVATION_RULES)
  return params, NamedSharding(mesh, P(*spec, None))


def bench_layer(cfg, mesh, chunks: list[int], repeats: int, pgle: bool = False) -> dict:
  """The MoE module, weights created sharded; B non-zero so that A gets gradients too.
  With pgle, each chunk count is also recompiled with its measured instruction profile
  (hylora.profile.pgle) and timed again: XLA's scheduler then knows what the expert kernels cost."""

  def make():
    layer = MoE(cfg.model, cfg.lora, init=ParamInit(0))
    if layer.experts.lora_b is not None:
      layer.experts.lora_b[...] = ParamInit(1).normal(layer.experts.lora_b.shape, 0.02)
    return nnx.split(layer, LoRAParam, ...)[1:]

  params, x_sharding = _layer_shardings(cfg, mesh)
  lora, rest = jax.jit(make, out_shardings=tuple(params))()
  b, t, d = cfg.train.batch_size, cfg.train.seq_len, cfg.model.d_model
  x, probe = (jax.device_put(jax.random.normal(key, (b, t, d), jnp.bfloat16), x_sharding)
              for key in jax.random.split(jax.random.key(3)))

  out, first = {"experts": cfg.model.moe.experts, "tokens": b * t, "chunks": {}}, None
  args = (lora, x, rest, probe)
  steps = {}  # compiled first, then timed together in alternating rounds
  for c in chunks:
    lowered = _layer_fwd_bwd(_with_chunks(cfg, c), mesh).lower(*args)
    step = steps[str(c)] = lowered.compile()
    (_, (y, dropped)), grads = step(*args)
    row = out["chunks"][str(c)] = {
        "dropped_fraction": float(dropped) / (b * t * cfg.model.moe.top_k),
        "schedule": hlo_schedule.summary(hlo_schedule.overlap_windows(step.as_text()))
    }
    if pgle:
      profiled_step, profiled = compile_with_profile(lowered, args)
      steps[f"{c}_pgle"] = profiled_step
      row["pgle"] = {
          "profiled": profiled,
          "schedule": hlo_schedule.summary(hlo_schedule.overlap_windows(profiled_step.as_text()))
      }
    if first is None:
      first = (y, grads)
      continue
    row["max_rel_diff"] = _max_rel_diff((y, grads), first)
    row["matches_first"] = row["max_rel_diff"] <= TOLERANCE
  # Every variant against the first chunk count, in the same rounds: speed-ups are
  # medians of per-round ratios, not ratios of separately timed figures.
  base = str(chunks[0])
  rounds = interleaved_ratios({
      k: f for k, f in steps.items() if k != base
  }, steps[base], *args, rounds=repeats, calls=1)
  out["interleaved"] = rounds
  for key in steps:
    c, profiled = key.removesuffix("_pgle"), key.endswith("_pgle")
    row = out["chunks"][c]["pgle"] if profiled else out["chunks"][c]
    row["fwd_bwd_ms"] = round(rounds["baseline_ms"] if key == base else rounds[key]["ms"], 3)
    if key != base:
      row["speedup"] = rounds[key]["median"]
  return out


def schedule_layer(cfg, mesh, chunks: list[int], hlo_dir: str | None = None) -> dict:
  """Compile only (abstract inputs): per chunk count, the MoE layer's all-to-alls and the
  compute XLA scheduled inside each asynchronous one. Runs wherever the mesh's devices
  can be compiled for, e.g. one GPU standing in for 8 (JAX_MOCK_GPU_TOPOLOGY=1x8x1)."""
  (lora_s, rest_s), x_sharding = _layer_shardings(cfg, mesh)
  abstract = nnx.eval_shape(lambda: MoE(cfg.model, cfg.lora, init=ParamInit(0)))
  lora, rest = (
      jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state,
                   shardings)
      for state, shardings in zip(nnx.split(abstract, LoRAParam, ...)[1:], (lora_s, rest_s)))
  b, t, d = cfg.train.batch_size, cfg.train.seq_len, cfg.model.d_model
  x = jax.ShapeDtypeStruct((b, t, d), jnp.bfloat16, sharding=x_sharding)
  out = {}
  for c in chunks:
    text = _layer_fwd_bwd(_with_chunks(cfg, c), mesh).lower(lora, x, rest, x).compile().as_text()
    windows = hlo_schedule.overlap_windows(text)
    out[str(c)] = {
        **hlo_schedule.summary(windows), "matmuls_inside":
            sorted({m for w in windows for m in w.matmuls})[:12]
    }
    if hlo_dir:
      os.makedirs(hlo_dir, exist_ok=True)
      name = f"moe_layer_{mesh.shape['fsdp']}x{mesh.shape['expert']}_chunks{c}.hlo.txt"
      with open(os.path.join(hlo_dir, name), "w") as f:
        f.write(text)
  return out


def bench_train_step(cfg, steps: int, peak: float) -> dict:
  devices = jax.device_count()
  r = whole_step(cfg, steps, jax.devices())
  flops = sum(flops_per_step(cfg).values()) / devices
  return {
      **r, "step_ms": r["step_seconds"] * 1e3,
      "overlap_chunks": cfg.model.moe.overlap_chunks,
      "tokens_per_s_per_gpu": r["tokens_per_s"] / devices,
      "model_flops_per_gpu": flops,
      "mfu": flops / r["step_seconds"] / peak
  }


def _size(n: float) -> str:
  unit, scale = next((u, s) for u, s in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("B", 1)) if n >= s)
  return f"{n / scale:.3g} {unit}"


def _transport_rows(t: dict) -> list[str]:
  a = t["all_to_all"]
  rows = [
      f"  {'transport':<17} {'bytes/GPU':>10} {'dispatch ms':>12} {'GB/s':>8} "
      f"{'combine ms':>11} {'GB/s':>8}",
      f"  {'plain all_to_all':<17} {_size(a['bytes_per_gpu']):>10} {a['ms']:>12.3f} "
      f"{a['gbps']:>8.4g}"
  ]
  for kind in ("padded", "ragged"):
    r, there, back = t[kind], t[kind].get("dispatch"), t[kind].get("combine")
    rows.append(f"  {kind:<17} skipped: {r['skipped']}" if "skipped" in
                r else f"  {kind:<17} {_size(r['bytes_per_gpu']):>10} {there['ms']:>12.3f} "
                f"{there['gbps']:>8.4g} {back['ms']:>11.3f} {back['gbps']:>8.4g}")
  return rows


def _kernels(schedule: dict) -> str:
  return ", ".join(f"{k} x{n}" for k, n in schedule["kernels_inside"].items()) or "none"


def format_report(report: dict) -> str:
  lines = []
  for name, r in report["meshes"].items():
    if "moe_layer_schedule" in r:
      for c, row in r["moe_layer_schedule"].items():
        lines.append(f"mesh {name}, {c} chunk(s): {row['count']} all-to-alls, "
                     f"{row['asynchronous']} asynchronous, {row['with_matmul_inside']} with a "
                     f"matmul scheduled inside ({row['compute_inside']} compute ops in all); "
                     f"kernels inside: {_kernels(row)}")
      continue
    lines.append(f"mesh {name}: top-{report['top_k']}, d_model {report['d_model']}")
    if "transport" in r:
      t = r["transport"]
      lines.append(f"  {t['tokens_per_gpu']} tokens/GPU, capacity {t['capacity']} rows per "
                   f"rank, dropped {100 * t['dropped_fraction']:.2f}%")
      lines += _transport_rows(t)
    if "moe_layer" in r:
      layer = r["moe_layer"]
      parts = [
          f"{c} chunk(s) {row['fwd_bwd_ms']:.2f} ms" +
          (f" ({row['speedup']:.2f}x, {'equal' if row['matches_first'] else 'DIFFERS'}: "
           f"{row['max_rel_diff']:.1e})" if "speedup" in row else "")
          for c, row in layer["chunks"].items()
      ]
      lines.append(f"  MoE layer ({layer['experts']} experts) fwd+bwd: " + "; ".join(parts))
      sched = [
          f"{c}: {row['schedule']['asynchronous']}/{row['schedule']['count']} async, "
          f"{row['schedule']['with_matmul_inside']} over a matmul, kernels inside "
          f"{_kernels(row['schedule'])}" for c, row in layer["chunks"].items()
      ]
      lines.append("  all-to-alls per chunk count: " + "; ".join(sched))
      profiled = [
          f"{c} chunk(s) {row['pgle']['fwd_bwd_ms']:.2f} ms, kernels inside "
          f"{_kernels(row['pgle']['schedule'])}"
          for c, row in layer["chunks"].items()
          if row.get("pgle", {}).get("profiled")
      ]
      if profiled:
        lines.append("  profile-guided schedule: " + "; ".join(profiled))
    if "train_step" in r:
      step = r["train_step"]
      lines.append(f"  train step: {step['step_ms']:.1f} ms, {step['tokens_per_s_per_gpu']:.0f} "
                   f"tokens/s/GPU, MFU {100 * step['mfu']:.1f}%, loss {step['final_loss']:.4f}")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  try:
    args = _args(sys.argv[1:] if argv is None else argv)
    if args.small:  # before JAX starts a backend
      os.environ.setdefault("JAX_PLATFORMS", "cpu")
      add_xla_flags(*SMALL_XLA_FLAGS)
      ensure_cpu_devices(8)
    if args.mock_gpus:
      if not args.schedule_only:
        raise ConfigError("--mock-gpus: mocked collectives move no data; use it with "
                          "--schedule-only")
      jax.config.update("jax_mock_gpu_topology", f"1x{args.mock_gpus}x1")
    runs = configs(args)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  first = next(iter(runs.values()))[0]
  report = {
      "device": str(jax.devices()[0]),
      "devices": jax.device_count(),
      "jax": jax.__version__,
      "small": args.small,
      "preset": first.preset,
      "d_model": first.model.d_model,
      "top_k": first.model.moe.top_k,
      "expert_ffn": first.model.moe.expert_ffn,
      "experts_per_rank": args.experts_per_rank,
      "capacity_factor": first.model.moe.capacity_factor,
      "peak_flops": args.peak,
      "meshes": {}
  }
  for name, (cfg, mesh) in runs.items():
    r = report["meshes"][name] = {"mesh": dict(mesh.shape)}
    if args.schedule_only:
      r["moe_layer_schedule"] = schedule_layer(cfg, mesh, args.chunks, args.hlo_dir)
      print(json.dumps({name: r}), flush=True)
      continue
    for part, run in (("transport", lambda: bench_transports(cfg, mesh, args.repeats)),
                      ("moe_layer",
                       lambda: bench_layer(cfg, mesh, args.chunks, args.repeats, args.pgle)),
                      ("train_step", lambda: bench_train_step(cfg, args.steps, args.peak))):
      if part not in args.parts:
        continue
      r[part] = run()
      print(json.dumps({name: {part: r[part]}}), flush=True)
  print(format_report(report))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
