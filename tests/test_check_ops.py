"""The op-check pipeline: every registered op has a check; a correct implementation
passes, a wrong forward, a wrong gradient and a crash each fail; reports are written."""

import json

import jax
import jax.numpy as jnp
import pytest

from experiments import check_ops
from hylora.ops import OpRegistry, catalog
from experiments.op_checks import CHECKS, OpCheck


def _norm_ref(x, w):
  return x * w


def _norm_inputs(key, size):
  del size
  k1, k2 = jax.random.split(key)
  return (jax.random.normal(k1, (16, 32)).astype(jnp.bfloat16), jax.random.normal(k2, (32,))), {}


@jax.custom_vjp
def _wrong_gradient(x, w):
  return x * w


_wrong_gradient.defvjp(lambda x, w: (x * w, (x, w)), lambda res, g:
                       (g * res[1], jnp.zeros_like(res[1])))  # drops dw


def _registry():
  reg = OpRegistry()
  reg.define("scale", _norm_ref)
  reg.register("scale", "good", lambda x, w: (x.astype(jnp.float32) * w).astype(x.dtype))
  reg.register("scale", "wrong_forward", lambda x, w: x * w * 1.05)
  reg.register("scale", "wrong_gradient", _wrong_gradient)
  reg.register("scale", "crashes", lambda x, w: x @ w[:3])
  reg.define("unchecked", _norm_ref)
  return reg


CHECKS_OF_REGISTRY = {"scale": OpCheck(_norm_inputs, grad_argnums=(0, 1))}


def test_every_catalog_op_has_a_check():
  assert set(CHECKS) == set(catalog().names())


def test_pipeline_tells_good_from_broken_implementations():
  reg = _registry()
  results = {
      r.impl: r for r in check_ops.check_all(["scale"], "small", timing=False, registry=reg,
                                             checks=CHECKS_OF_REGISTRY)
  }
  assert results["reference"].ok and results["good"].ok
  assert results["wrong_forward"].status == "FAIL" and results["wrong_forward"].fwd_rms > 0.04
  wrong_grad = results["wrong_gradient"]
  assert wrong_grad.status == "FAIL" and wrong_grad.fwd_rms < 1e-2 and wrong_grad.bwd_rms > 0.5
  assert results["crashes"].status == "error" and "TypeError" in results["crashes"].note
  unchecked = check_ops.check_op("unchecked", "small", timing=False, registry=reg,
                                 checks=CHECKS_OF_REGISTRY)
  assert [r.status for r in unchecked] == ["unchecked"]


def test_index_outputs_are_compared_as_sets():

  def make(key, size):
    return (jnp.arange(12, dtype=jnp.int32).reshape(3, 4),), {}

  reg = OpRegistry()
  reg.define("pick", lambda i: i)
  reg.register("pick", "reversed", lambda i: i[:, ::-1])
  reg.register("pick", "one_wrong", lambda i: i.at[0, 0].set(99))
  results = {
      r.impl: r
      for r in check_ops.check_all(["pick"], "small", registry=reg,
                                   checks={"pick": OpCheck(make, fwd_rtol=0.0, index_sets=True)})
  }
  assert results["reversed"].ok
  assert results["one_wrong"].status == "FAIL" and results["one_wrong"].fwd_max == 1 / 12


def test_worked_example_residual_mix_forward_and_backward():
  results = check_ops.check_op("residual_mix", "small", timing=False)
  assert [r.impl for r in results] == ["reference", "pallas"]
  for r in results:
    assert r.ok, r
    assert r.bwd_rms is not None and r.bwd_rms < 1e-2


def test_command_writes_reports_and_rejects_unknown_ops(tmp_path, capsys):
  assert check_ops.main(["--ops", "rms_norm", "grouped_matmul", "--out", str(tmp_path)]) == 0
  report = json.loads((tmp_path / "check_ops.json").read_text())
  assert report["failures"] == 0
  assert {(r["op"], r["impl"]) for r in report["results"]} == {("rms_norm", "reference"),
                                                               ("grouped_matmul", "reference"),
                                                               ("grouped_matmul", "mosaic"),
                                                               ("grouped_matmul", "loop")}
  assert "| grouped_matmul | mosaic | pass |" in (tmp_path / "check_ops.md").read_text()
  assert "4/4 checks passed" in capsys.readouterr().out
  assert check_ops.main(["--ops", "no_such_op"]) == 2
  assert capsys.readouterr().err.startswith("error: --ops")


@pytest.mark.parametrize("size", ["large"])
def test_bad_size_is_named(size):
  with pytest.raises(ValueError, match="size must be"):
    CHECKS["rms_norm"].make_inputs(jax.random.key(0), size)
