"""One GPU's share of a 1M-token sequence split over devices: top-K sparse attention.

    PYTHONPATH=src:. python3 experiments/bench_long_context_sparse.py [--keys 1048576]

On a sequence split (meshes/gathered_keys.py) each device holds --local queries and
gathers every one of --keys keys (128 devices of 8192 tokens at the defaults). This
times one device's work on one GPU, 2p8t shapes in bf16 (64 query and 8 KV heads of
128, 64 indexer heads of 128, top-K 2048), for three shares of the queries:

- first: the first device's (query_offset 0, the fewest causal keys);
- last: the last device's (query_offset keys - local, every key causal);
- balanced: device --balanced-device's in the balanced order (half-blocks d and
  2P - 1 - d of the 2P in the sequence, each scored at its own query_offset), which
  gives every device the same indexer work.

For each: the indexer with its top-K, the sparse attention forward + backward on that
selection, and both as one program (the share), each by `experiments.timing.median_ms`
with the compiled program's temporary memory (--no-parts: the share only); then the first and balanced shares
against the last in alternating rounds (`interleaved_ratios`: > 1, faster than the last
device's share). The implementations are the registered ones ("auto" for the GPU, the
Pallas kernels by name under --interpret). Prints one JSON object per measurement, then
a table. --interpret: tiny shapes on CPU with the kernels interpreted (the test's mode).
"""
import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp

from experiments.bench_sparse_attention import compiled_with_temp, loss_of
from experiments.timing import failed, interleaved_ratios, median_ms
from hylora.ops.catalog import catalog
from meshes.gathered_keys import balanced_half_blocks
from pallas_kernels.sparse_attention.by_density import prefers_dense

INDEXER, ATTEND = "sparse_attention.topk_indices", "sparse_attention.attend"
SHARES = ("first", "last", "balanced")


@dataclasses.dataclass(frozen=True)
class Shapes:
  keys: int = 1 << 20
  local: int = 8192
  q_heads: int = 64
  kv_heads: int = 8
  head_dim: int = 128
  index_heads: int = 64
  index_head_dim: int = 128
  top_k: int = 2048


TINY = Shapes(keys=256, local=32, q_heads=4, kv_heads=2, head_dim=16, index_heads=2,
              index_head_dim=16, top_k=8)


def share_offsets(name: str, shapes: Shapes, balanced_device: int = 0) -> tuple[int, ...]:
  """First positions of the share's equal parts of queries (each part a contiguous range)."""
  devices = shapes.keys // shapes.local
  if name == "first":
    return (0,)
  if name == "last":
    return (shapes.keys - shapes.local,)
  half = shapes.local // 2
  return tuple(block * half for block in balanced_half_blocks(devices)[balanced_device])


def causal_keys(offsets, shapes: Shapes) -> int:
  """Keys at or before each query of the share, summed (the indexer's causal work)."""
  part = shapes.local // len(offsets)
  return sum(part * start + part * (part + 1) // 2 for start in offsets)


def make_inputs(shapes: Shapes, seed: int = 0):
  s = shapes
  ks = jax.random.split(jax.random.key(seed), 6)
  normal = lambda key, shape: jax.random.normal(key, shape, jnp.bfloat16)
  indexer = (normal(ks[0], (1, s.local, s.index_heads, s.index_head_dim)),
             normal(ks[1], (1, s.keys, s.index_head_dim)),
             jax.random.uniform(ks[2], (1, s.local, s.index_heads), jnp.float32))
  attention = (normal(ks[3], (1, s.local, s.q_heads, s.head_dim)),
               normal(ks[4], (1, s.keys, s.kv_heads, s.head_dim)),
               normal(ks[5], (1, s.keys, s.kv_heads, s.head_dim)))
  return indexer, attention


def implementations(interpret: bool):
  """(indexer, attention, their names): the registered GPU choice, or Pallas by name."""
  picks = [
      catalog().pick(op, "pallas") if interpret else catalog().pick(op, "auto", "gpu")
      for op in (INDEXER, ATTEND)
  ]
  return picks[0].load(), picks[1].load(), {op: p.name for op, p in zip((INDEXER, ATTEND), picks)}


def share_programs(offsets, top_k, indexer, attend):
  """(select, attention_fwdbwd, share): the share's indexer (one call per part, each at
    its own offset), the attention's forward + backward on a given selection, and both."""

  def select(q_idx, k_idx, w):
    parts = len(offsets)
    n = q_idx.shape[1] // parts
    return jnp.concatenate([
        indexer(q_idx[:, i * n:(i + 1) * n], k_idx, w[:, i * n:(i + 1) * n], top_k=top_k,
                query_offset=offset) for i, offset in enumerate(offsets)
    ], axis=1)

  def attention_fwdbwd(q, k, v, idx):
    return jax.grad(loss_of(attend, idx), (0, 1, 2))(q, k, v)

  def share(q_idx, k_idx, w, q, k, v):
    return attention_fwdbwd(q, k, v, select(q_idx, k_idx, w))

  return select, attention_fwdbwd, share


def timed(fn, args, reps):
  try:
    compiled, gb = compiled_with_temp(fn, *args)
    return {"ms": round(median_ms(compiled, *args, reps=reps), 3), "temp_GB": gb}, compiled
  except Exception as e:  # report, keep going
    return {"ms": failed(e)}, None


def bench(shapes: Shapes, interpret: bool = False, balanced_device: int = 0, reps: int = 5,
          rounds: int = 5, parts: bool = True):
  devices, rest = divmod(shapes.keys, shapes.local)
  if rest or shapes.local % 2:
    raise ValueError(f"--keys {shapes.keys} must be a multiple of an even --local {shapes.local}")
  if not 0 <= balanced_device < devices:
    raise ValueError(f"--balanced-device {balanced_device} must be in [0, {devices})")
  indexer, attend, names = implementations(interpret)
  (q_idx, k_idx, w), (q, k, v) = make_inputs(shapes)
  s = shapes
  gathered = s.keys * (2 * s.kv_heads * s.head_dim + s.index_head_dim) * 2
  dense = prefers_dense(q.shape, k.shape, s.top_k, q.dtype)
  print(
      json.dumps({
          "device": str(jax.devices()[0]),
          "jax": jax.__version__,
          **dataclasses.asdict(shapes),
          "devices": devices,
          "gathered_keys_GB": round(gathered / 1e9, 3),
          "implementations": names,
          # what the "by_density" choice runs at these shapes
          "by_density_picks": "masked_dense" if dense else "pallas"
      }),
      flush=True)
  rows, shares = {}, {}
  most = causal_keys(share_offsets("last", shapes), shapes)
  for name in SHARES:
    offsets = share_offsets(name, shapes, balanced_device)
    select, attention_fwdbwd, share = share_programs(offsets, s.top_k, indexer, attend)
    row = {
        "share": name,
        "query_offsets": list(offsets),
        "causal_keys_vs_last": round(causal_keys(offsets, shapes) / most, 3)
    }
    if parts:
      row["indexer"], compiled = timed(select, (q_idx, k_idx, w), reps)
      if compiled is not None:
        idx = compiled(q_idx, k_idx, w)
        row["attention_fwdbwd"], _ = timed(attention_fwdbwd, (q, k, v, idx), reps)
    args = (q_idx, k_idx, w, q, k, v)
    row["total"], compiled = timed(share, args, reps)
    if compiled is not None:
      shares[name] = lambda c=compiled: c(*args)
    rows[name] = row
    print(json.dumps(row), flush=True)
  if "last" in shares:
    try:
      ratios = interleaved_ratios({
          n: f for n, f in shares.items() if n != "last"
      }, shares["last"], rounds=rounds, calls=1)
    except Exception as e:  # report, keep going
      ratios = {"failed": failed(e)}
    print(json.dumps({"share_vs_last": ratios}), flush=True)
    for name, row in rows.items():
      row["vs_last"] = ratios.get(name, {}).get("median") if name != "last" else 1.0
  print_table(rows)
  return rows


def print_table(rows):
  cols = ("share", "offsets", "causal keys", "indexer ms", "attn fwd+bwd ms", "share ms",
          "share temp GB", "last / share")
  cell = lambda part, key: (f"{part[key]:.3f}"
                            if isinstance(part.get(key), float) else str(part.get(key, "-"))[:12])
  lines = [cols]
  for name, row in rows.items():
    offsets = row["query_offsets"]
    lines.append((name, ",".join(map(str, offsets)), f"{row['causal_keys_vs_last']:.3f}",
                  cell(row.get("indexer", {}), "ms"), cell(row.get("attention_fwdbwd", {}),
                                                           "ms"), cell(row["total"], "ms"),
                  cell(row["total"],
                       "temp_GB"), "-" if row.get("vs_last") is None else f"{row['vs_last']:.3f}"))
  widths = [max(len(line[i]) for line in lines) for i in range(len(cols))]
  for line in lines:
    print("  ".join(c.rjust(n) for c, n in zip(line, widths)), flush=True)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--keys", type=int, default=None, help="keys of the whole sequence "
                 "(default 1048576; 256 under --interpret)")
  p.add_argument("--local", type=int, default=None, help="queries per device (default 8192; "
                 "32 under --interpret)")
  p.add_argument("--top-k", type=int, default=None)
  p.add_argument("--balanced-device", type=int, default=0,
                 help="the device whose balanced share is timed (every device's is equal work)")
  p.add_argument("--reps", type=int, default=5, help="timed calls per median_ms figure")
  p.add_argument("--rounds", type=int, default=5, help="alternating rounds of the comparison")
  p.add_argument("--no-parts", action="store_true",
                 help="time each share whole only, not its indexer and attention apart")
  p.add_argument("--interpret", action="store_true",
                 help="tiny shapes on CPU, the Pallas kernels interpreted")
  a = p.parse_args(argv)
  shapes = TINY if a.interpret else Shapes()
  given = {"keys": a.keys, "local": a.local, "top_k": a.top_k}
  shapes = dataclasses.replace(shapes, **{k: v for k, v in given.items() if v is not None})
  return bench(shapes, interpret=a.interpret, balanced_device=a.balanced_device, reps=a.reps,
               rounds=a.rounds, parts=not a.no_parts)


if __name__ == "__main__":
  main()
