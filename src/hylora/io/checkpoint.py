"""Training checkpoints (orbax-checkpoint): the LoRA parameters, the optimizer state, and
where the run stands (step, seed of the step RNG, data position, non-finite counters,
the resolved config), under `<out>/checkpoints/<step>/`.

Saves are asynchronous (the step loop continues while the files are written), the last
`keep` are kept, and each is atomic: orbax writes into a temporary folder and renames it
when complete, so a kill during a save leaves the previous checkpoint as the latest and
the unfinished one is never listed. Restoring first checks the stored config and array
shapes against the current run and refuses any mismatch; an unreadable checkpoint is
refused with its path, never half-loaded.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from hylora.core.config import Config
from hylora.core.errors import CheckpointError
from hylora.core.overrides import to_dict

FORMAT = 1
# Config fields a resumed run may change: they do not alter a step's math or the data
# order (train.steps moves the end of the run; the learning-rate schedule follows it).
MAY_CHANGE = ("train.steps", "train.max_nonfinite_in_a_row", "checkpoint.", "mesh.", "kernels.",
              "memory.")


@dataclasses.dataclass
class Position:
  """Where a run stands after `step` completed optimizer steps."""

  step: int = 0
  data: dict = dataclasses.field(default_factory=dict)  # data_state() of the data stream
  nonfinite_total: int = 0
  nonfinite_in_a_row: int = 0
  # Expert placement, router biases and load windows (hylora.train.balancer.state): the
  # LoRA factors and optimizer moments are stored under this placement.
  balance: dict = dataclasses.field(default_factory=dict)

  def meta(self, cfg: Config) -> dict:
    return {
        "format": FORMAT,
        "step": self.step,
        "data": self.data,
        "nonfinite_total": self.nonfinite_total,
        "nonfinite_in_a_row": self.nonfinite_in_a_row,
        "balance": self.balance,
        # The step RNG is jax.random.fold_in(key(seed), step): seed + step restore it.
        "rng": {
            "seed": cfg.train.seed,
            "derivation": "fold_in(key(train.seed), step)"
        },
        "config": to_dict(cfg)
    }

  @classmethod
  def from_meta(cls, meta: dict) -> "Position":
    return cls(int(meta["step"]), dict(meta["data"]), int(meta["nonfinite_total"]),
               int(meta["nonfinite_in_a_row"]), dict(meta.get("balance") or {}))


def stream_snapshot(stream) -> dict:
  """This process's position of the data stream now (cheap, no collective): what
  `data_state` saves when the stream has moved on since (a batch fetched ahead)."""
  if hasattr(stream, "position"):
    return {"packer": list(stream.position)}
  return dict(stream.state())


def data_state(stream, snapshot: dict | None = None) -> dict:
  """The data stream's position (at `snapshot`, default now): the Packer's (the same on
  every process) or every process's ConversationLoader state (gathered, one entry per
  process)."""
  snapshot = stream_snapshot(stream) if snapshot is None else snapshot
  if "packer" in snapshot:
    return {"packer": list(snapshot["packer"])}
  state = snapshot
  counters = np.asarray([state["next_example"], state["truncated"], state["skipped"]], np.int64)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    counters = multihost_utils.process_allgather(counters)
  rows = np.asarray(counters).reshape(jax.process_count(), 3).tolist()
  return {
      "loader": {
          k: state[k] for k in ("process_count", "seed")
      },
      "per_process": [dict(zip(("next_example", "truncated", "skipped"), r)) for r in rows]
  }


def restore_data(stream, data: dict):
  """The stream continued from a saved `data_state` (a new Packer, or the loader)."""
  if "packer" in data and hasattr(stream, "position"):
    return stream.resumed_at(data["packer"])
  if "per_process" in data and hasattr(stream, "restore"):
    saved = data["per_process"]
    mine = saved[jax.process_index()] if jax.process_index() < len(saved) else {}
    stream.restore({**data["loader"], **mine, "process_index": jax.process_index()})
    return stream
  raise CheckpointError(f"the checkpoint's data position {sorted(data)} does not fit this "
                        "run's data source (train.data)")


def trim_metrics(path: Path, step: int) -> None:
  """Keeps the metrics.jsonl records of steps before `step` (a fresh run: none), so a
  resumed run appends where its checkpoint left off."""
  import json

  keep = []
  if step > 0 and path.exists():
    for line in path.read_text().splitlines():
      if line.strip() and json.loads(line).get("step", step) < step:
        keep.append(line)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("".join(line + "\n" for line in keep))


def _dotted(tree: dict, prefix: str = "") -> dict:
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_dotted(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def config_differences(stored: dict, cfg: Config) -> list[str]:
  """Fields whose stored value differs from `cfg` and that a resume may not change
  (fields only one side knows, from another version of the code, are not compared)."""
  old, new = _dotted(stored), _dotted(to_dict(cfg))
  diffs = []
  for name in sorted(set(old) & set(new)):
    if name.startswith(MAY_CHANGE) or name in MAY_CHANGE:
      continue
    if old[name] != new[name]:
      diffs.append(f"{name}={old[name]!r} there, {new[name]!r} now")
  return diffs


def _shapes(tree) -> dict[str, tuple]:
  """"/"-joined path -> (shape, dtype); named tuples and dicts give the same paths."""

  def name(k):
    return str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))

  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {"/".join(map(name, p)): (tuple(x.shape), str(x.dtype)) for p, x in flat}


def _private_copy(tree):
  """The train step donates its inputs: orbax gets buffers of its own to write from."""
  return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


class Checkpoints:

  def __init__(self, out_dir: str | Path, *, every: int = 0, keep: int = 3,
               async_save: bool = True):
    self.directory = Path(out_dir).absolute() / "checkpoints"
    self.every = every
    options = ocp.CheckpointManagerOptions(max_to_keep=max(keep, 1), create=True,
                                           enable_async_checkpointing=async_save)
    handlers = {
        "lora": ocp.StandardCheckpointHandler(),
        "opt_state": ocp.StandardCheckpointHandler(),
        "meta": ocp.JsonCheckpointHandler()
    }
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

  def due(self, steps_done: int, total: int) -> bool:
    """Save after every `every` steps and after the last one."""
    return steps_done == total or (self.every > 0 and steps_done % self.every == 0)

  def save(self, position: Position, cfg: Config, lora, opt_state) -> None:
    if position.step in self.manager.all_steps():
      return
    args = ocp.args.Composite(lora=ocp.args.StandardSave(_private_copy(lora)),
                              opt_state=ocp.args.StandardSave(_private_copy(opt_state)),
                              meta=ocp.args.JsonSave(position.meta(cfg)))
    self.manager.save(position.step, args=args, force=True)

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def latest(self) -> int | None:
    return self.manager.latest_step()

  def _where(self, step: int) -> str:
    return str(self.directory / str(step))

  def _refuse(self, step: int, why: str) -> CheckpointError:
    earlier = [s for s in self.steps() if s < step]
    hint = (f"; delete it to resume from step {earlier[-1]}"
            if earlier else "; delete it (or use a new --out) to start afresh")
    return CheckpointError(f"checkpoint {self._where(step)}: {why}{hint}")

  def meta(self, step: int) -> dict:
    try:
      meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
      meta = meta["meta"]
      if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"unknown format {meta!r:.80}")
      Position.from_meta(meta)
    except Exception as e:  # noqa: BLE001 - any failure means the metadata is unusable
      raise self._refuse(step, f"its metadata is unreadable ({_brief(e)})") from None
    return meta

  def check_config(self, step: int, cfg: Config) -> dict:
    """The checkpoint's metadata, if it was written by a run with the same settings."""
    meta = self.meta(step)
    diffs = config_differences(meta["config"], cfg)
    if diffs:
      raise CheckpointError(f"checkpoint {self._where(step)} belongs to a run with a different "
                            f"configuration: {'; '.join(diffs[:4])}" +
                            (f" (+{len(diffs) - 4} more)" if len(diffs) > 4 else "") +
                            "; resume with the same settings or use a new --out")
    return meta

  def restore(self, step: int, cfg: Config, lora_abstract, opt_abstract):
    """(lora, opt_state, Position) of checkpoint `step`, placed like the abstract trees."""
    meta = self.check_config(step, cfg)
    try:
      stored = self.manager.item_metadata(step)
      stored = {
          "lora": _shapes(stored["lora"].tree),
          "opt_state": _shapes(stored["opt_state"].tree)
      }
    except Exception as e:  # noqa: BLE001
      raise self._refuse(step, f"its array metadata is unreadable ({_brief(e)})") from None
    for name, want in (("lora", _shapes(lora_abstract)), ("opt_state", _shapes(opt_abstract))):
      got = stored[name]
      if set(got) != set(want):
        extra = sorted(set(got) ^ set(want))[:2]
        raise CheckpointError(f"checkpoint {self._where(step)}: its {name} holds different "
                              f"arrays than this model ({', '.join(extra)} ...)")
      for key, (shape, dtype) in want.items():
        if got[key][0] != shape or got[key][1] != dtype:
          raise CheckpointError(f"checkpoint {self._where(step)}: {name}/{key} is "
                                f"{got[key][1]}{list(got[key][0])} there, this model needs "
                                f"{dtype}{list(shape)}")
    try:
      restored = self.manager.restore(
          step, args=ocp.args.Composite(lora=ocp.args.StandardRestore(lora_abstract),
                                        opt_state=ocp.args.StandardRestore(opt_abstract)))
      lora, opt_state = restored["lora"], restored["opt_state"]
      jax.block_until_ready((lora, opt_state))
    except Exception as e:  # noqa: BLE001
      raise self._refuse(step, f"its arrays are unreadable ({_brief(e)})") from None
    return lora, opt_state, Position.from_meta(meta)

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def _brief(error: Exception) -> str:
  text = str(error).strip().splitlines()
  return f"{type(error).__name__}: {text[0][:200] if text else ''}"
