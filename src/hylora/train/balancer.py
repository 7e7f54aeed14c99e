"""Balancing the experts of a frozen router during a run (docs/moe.md).

Host side, after every step: the step's per-expert load `[layers, experts]` (the routers'
counts) gives the balance metrics under the current placement and is added to two load
windows. Every `moe.rebalance_every` steps each MoE layer's placement is re-planned from
its window (balance.plan_placement: hot experts spread over the expert-parallel ranks and
copied into spare slots) and applied to the frozen expert weights, the LoRA factors and
the optimizer moments together (expert_sites.relocate), so a re-placement changes where
experts live, not what the model computes. Every `moe.bias_update_every` steps the
aux-loss-free router bias moves toward the window's mean load (balance.update_router_bias);
the bias steers selection only, never the combine weights, so it does change routing.
"""

from __future__ import annotations

import jax
import numpy as np

from hylora.core.config import Config
from hylora.model.ffn import balance
from hylora.train import expert_sites

BIAS = ("router", "bias")


def rank_load_ratio(load: np.ndarray, tables: np.ndarray, ranks: int) -> np.ndarray:
  """load [L, E], tables [L, slots] -> [L] busiest rank / mean rank (copies of an expert
  share its load; slot s sits on rank s // (slots / ranks))."""
  layers, experts = load.shape
  rows = np.arange(layers)[:, None]
  copies = np.stack([np.bincount(t, minlength=experts) for t in tables])
  per_slot = load[rows, tables] / np.maximum(copies[rows, tables], 1)
  per_rank = per_slot.reshape(layers, ranks, -1).sum(-1)
  return per_rank.max(-1) / np.maximum(per_rank.mean(-1), 1e-9)


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def _with(tree: dict, path: tuple, value) -> dict:
  """A copy of the nested dict with `path` set (the nodes along it copied or created)."""
  out = dict(tree)
  out[path[0]] = value if len(path) == 1 else _with(tree.get(path[0], {}), path[1:], value)
  return out


def _name(path: tuple) -> str:
  return "/".join(map(str, path))


class ExpertBalancer:

  def __init__(self, cfg: Config, mesh, frozen: dict):
    self.moe = moe = cfg.model.moe
    self.ranks = mesh.shape["expert"]
    self.sites = expert_sites.find_sites(cfg, frozen)
    self.moe_layers = np.asarray(sorted(i for s in self.sites for i in s.layers), np.int64)
    self.tables = self._read_tables(frozen)
    self.placement_window = np.zeros((cfg.model.layers, moe.experts))
    self.bias_window = np.zeros_like(self.placement_window)
    self._relocators = {}
    self._update_bias = jax.jit(
        lambda bias, load: balance.update_router_bias(bias, load, moe.bias_update_rate),
        donate_argnums=0)

  def _read_tables(self, frozen) -> dict:
    tables = expert_sites.tables(frozen, self.sites)
    return {p: np.asarray(jax.device_get(t)).astype(np.int32) for p, t in tables.items()}

  def _layer_tables(self, tables: dict) -> np.ndarray:
    """[MoE layers, slots] in the order of `moe_layers`."""
    by_layer = {i: tables[s.path][r] for s in self.sites for r, i in enumerate(s.layers)}
    return np.stack([by_layer[i] for i in self.moe_layers])

  def observe(self, load) -> dict:
    """The step's load [layers, experts] -> balance metrics; adds it to the windows."""
    if not self.sites:
      return {}
    load = np.asarray(load, np.float64)
    self.placement_window += load
    self.bias_window += load
    ratios = rank_load_ratio(load[self.moe_layers], self._layer_tables(self.tables), self.ranks)
    return {
        "rank_load_max_over_mean": float(ratios.max()),
        "rank_load_max_over_mean_avg": float(ratios.mean())
    }

  def after_step(self, steps_done: int, lora, opt_state, frozen):
    """(lora, opt_state, frozen, metrics): re-places experts and updates router biases
    when due after `steps_done` steps."""
    out = {}
    every = self.moe.rebalance_every
    if self.sites and every and steps_done % every == 0:
      lora, opt_state, frozen, out = self.rebalance(lora, opt_state, frozen)
    every = self.moe.bias_update_every
    if self.sites and every and steps_done % every == 0:
      frozen = self.update_bias(frozen)
      out["router_bias_updated"] = 1.0
    return lora, opt_state, frozen, out

  def plan(self, window: np.ndarray) -> dict:
    """New tables from a load window [layers, experts]; a layer keeps its table unless
    the plan lowers its window's busiest-rank / mean ratio."""
    new = {}
    for site in self.sites:
      rows = []
      for r, layer in enumerate(site.layers):
        old = self.tables[site.path][r]
        row = old
        if window[layer].sum() > 0:
          plan = balance.plan_placement(window[layer], self.ranks, old.shape[0] // self.ranks)
          ratio = rank_load_ratio(window[[layer, layer]], np.stack([old, plan]), self.ranks)
          row = plan if ratio[1] < ratio[0] - 1e-9 else old
        rows.append(row.astype(np.int32))
      new[site.path] = np.stack(rows)
    return new

  def rebalance(self, lora, opt_state, frozen):
    window = self.placement_window
    new = self.plan(window)
    loads = window[self.moe_layers]
    before = rank_load_ratio(loads, self._layer_tables(self.tables), self.ranks)
    after = rank_load_ratio(loads, self._layer_tables(new), self.ranks)
    moved = sum(int((new[p] != self.tables[p]).any(-1).sum()) for p in new)
    if moved:
      lora, opt_state, frozen = self.apply(lora, opt_state, frozen, new)
    self.placement_window = np.zeros_like(window)
    return lora, opt_state, frozen, {
        "rebalanced_layers": float(moved),
        "rebalance_window_before": float(before.mean()),  # mean over MoE layers
        "rebalance_window_after": float(after.mean())
    }

  def apply(self, lora, opt_state, frozen, new: dict, *, frozen_only: bool = False):
    """Moves every per-slot leaf (weights, LoRA factors, optimizer moments) to `new`."""
    experts = {}
    for site in self.sites:
      node = _get(frozen, site.path)
      experts = _with(experts, site.path, {
          "experts": node["experts"],
          expert_sites.PLACEMENT: node[expert_sites.PLACEMENT]
      })
    # Host arrays: every process passes the same tables (multi-host safe).
    trees = (experts,) if frozen_only else (experts, lora, opt_state)
    moved = self._relocator(trees)(trees, self.tables, new)
    for site in self.sites:
      node = dict(_get(frozen, site.path))
      node.update(_get(moved[0], site.path))
      frozen = _with(frozen, site.path, node)
    self.tables = {p: np.asarray(t, np.int32) for p, t in new.items()}
    if frozen_only:
      return frozen
    return moved[1], moved[2], frozen

  def _relocator(self, trees):
    """The jitted move, compiled once per tree structure; outputs keep the inputs'
    shardings (the compiled train step expects them) and reuse their buffers."""
    key = jax.tree.structure(trees)
    if key not in self._relocators:
      experts = self.moe.experts
      self._relocators[key] = jax.jit(
          lambda trees, old, new: expert_sites.relocate(trees, old, new, experts),
          out_shardings=jax.tree.map(lambda a: a.sharding, trees), donate_argnums=0)
    return self._relocators[key]

  def update_bias(self, frozen):
    for site in self.sites:
      path = site.path + BIAS
      load = self.bias_window[list(site.layers)].astype(np.float32)
      frozen = _with(frozen, path, self._update_bias(_get(frozen, path), load))
    self.bias_window = np.zeros_like(self.bias_window)
    return frozen

  # ---- checkpoints: the placement, biases and windows travel in the metadata (JSON)

  def state(self, frozen) -> dict:
    if not self.sites:
      return {}
    bias = {
        _name(s.path): np.asarray(jax.device_get(_get(frozen, s.path + BIAS))).tolist()
        for s in self.sites
    }
    return {
        "placement": {
            _name(p): t.tolist() for p, t in self.tables.items()
        },
        "router_bias": bias,
        "placement_window": self.placement_window.tolist(),
        "bias_window": self.bias_window.tolist()
    }

  def restore(self, state: dict, frozen):
    """The frozen tree of a fresh start brought to a checkpoint's `state` (the LoRA
    factors and optimizer state restored from it are stored under that placement)."""
    if not self.sites or not state:
      return frozen
    new = {s.path: np.asarray(state["placement"][_name(s.path)], np.int32) for s in self.sites}
    if any((new[p] != self.tables[p]).any() for p in new):
      frozen = self.apply(None, None, frozen, new, frozen_only=True)
    for site in self.sites:
      path = site.path + BIAS
      old = _get(frozen, path)
      value = np.asarray(state["router_bias"][_name(site.path)], old.dtype)
      frozen = _with(frozen, path, jax.device_put(value, old.sharding))
    self.placement_window = np.asarray(state["placement_window"], np.float64)
    self.bias_window = np.asarray(state["bias_window"], np.float64)
    return frozen
