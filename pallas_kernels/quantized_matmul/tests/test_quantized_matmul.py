"""The differentiable ops: the custom VJP (input gradient only, on the kernel's other
orientation; no gradient work for the frozen codes and scales), on the interpreted
Pallas kernel; the choice of the loop stand-in on CPU; the input checks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quantized_matmul import (formats, make_quantized_grouped_matmul,
                                             make_quantized_matmul, quantized_grouped_matmul,
                                             quantized_grouped_matmul_reference, quantized_matmul,
                                             quantized_matmul_reference)
from pallas_kernels.quantized_matmul.kernel import TileConfig, quantized_grouped_matmul_kernel
from pallas_kernels.quantized_matmul.loop_over_groups import loop_product
from pallas_kernels.quantized_matmul.tests._inputs import (GROUP_SIZES, M, ROWS_IN_GROUPS, SHAPES,
                                                           activations, assert_close_to_reference,
                                                           packed_weights, product_bound)

TILES = TileConfig(bm=16, bn=32, bk=64, num_warps=4, num_stages=1)


def interpreted_kernel(x, codes, scales, group_sizes, *, fmt, transpose):
  return quantized_grouped_matmul_kernel(x, codes, scales, group_sizes, fmt=fmt,
                                         transpose=transpose, config=TILES, interpret=True)


interpreted_grouped = make_quantized_grouped_matmul(interpreted_kernel)


def _loss(op, cot, fmt_name, sizes):
  return lambda x, codes, scales: jnp.sum(
      op(x, codes, scales, sizes, fmt=fmt_name).astype(jnp.float32) * cot)


@pytest.mark.parametrize("fmt_name", ["mxfp4", "int4"])
def test_grad_of_the_kernel_op_matches_reference(fmt_name):
  n, k = SHAPES[fmt_name]
  codes, scales = packed_weights(30, fmt_name, len(GROUP_SIZES), n, k)
  x = activations(31, M, k)
  cot = activations(32, M, n).astype(jnp.float32)
  sizes = jnp.asarray(GROUP_SIZES)
  got = jax.grad(_loss(interpreted_grouped, cot, fmt_name, sizes))(x, codes, scales)
  want = jax.grad(_loss(quantized_grouped_matmul_reference, cot, fmt_name, sizes))(x, codes, scales)
  assert got.dtype == jnp.bfloat16
  w = formats.dequantize(codes, scales, fmt_name)
  assert_close_to_reference(got, want, product_bound(cot, w, GROUP_SIZES, transpose=True),
                            ROWS_IN_GROUPS)


def _recording(calls):

  def kernel(x, codes, scales, group_sizes, *, fmt, transpose):
    calls.append("input_gradient" if transpose else "forward")
    return loop_product(x, codes, scales, group_sizes, fmt=fmt, transpose=transpose)

  return make_quantized_grouped_matmul(kernel)


def test_backward_runs_only_the_input_gradient_and_keeps_no_activation():
  n, k = SHAPES["int4"]
  codes, scales = packed_weights(33, "int4", len(GROUP_SIZES), n, k)
  x = activations(34, M, k)
  sizes = jnp.asarray(GROUP_SIZES)
  calls = []
  op = _recording(calls)
  cot = jnp.ones((M, n), jnp.float32)
  jax.grad(_loss(op, cot, "int4", sizes))(x, codes, scales)
  assert calls == ["forward", "input_gradient"]
  # frozen weights: asking for the scales' gradient runs no backward kernel, gives zeros
  calls.clear()
  dscales = jax.grad(_loss(op, cot, "int4", sizes), argnums=2)(x, codes, scales)
  assert calls == ["forward"]
  np.testing.assert_array_equal(np.asarray(dscales, np.float32), 0.0)
  # the residuals are the packed weights and group sizes, not the activations
  _, vjp = jax.vjp(lambda x: op(x, codes, scales, sizes, fmt="int4"), x)
  saved = jax.tree.leaves(vjp)
  assert not any(leaf.shape == x.shape for leaf in saved if hasattr(leaf, "shape"))


def test_single_matrix_op_on_the_kernel():
  n, k = SHAPES["fp8_block"]
  codes, scales = packed_weights(35, "fp8_block", 1, n, k)
  op = make_quantized_matmul(interpreted_grouped)
  x = activations(36, 20, k).reshape(4, 5, k)
  cot = activations(37, 20, n).reshape(4, 5, n).astype(jnp.float32)
  loss = lambda f: (lambda x: jnp.sum(f(x, codes[0], scales[0], fmt="fp8_block") * cot))
  got = jax.grad(loss(op))(x)
  want = jax.grad(loss(quantized_matmul_reference))(x)
  w = formats.dequantize(codes, scales, "fp8_block")
  bound = product_bound(cot.reshape(20, n), w, np.array([20]), transpose=True)
  assert_close_to_reference(got.reshape(20, k), want.reshape(20, k), bound, 20)


def test_public_ops_on_cpu_run_the_loop_not_an_interpreted_kernel():
  n, k = SHAPES["mxfp4"]
  codes, scales = packed_weights(38, "mxfp4", 3, n, k)
  x = activations(39, 12, k)
  sizes = jnp.array([4, 0, 5], jnp.int32)
  jaxpr = str(
      jax.make_jaxpr(functools.partial(quantized_grouped_matmul, fmt="mxfp4"))(x, codes, scales,
                                                                               sizes))
  assert "pallas_call" not in jaxpr and "scan" in jaxpr  # the fori_loop over groups
  out = quantized_grouped_matmul(x, codes, scales, sizes, fmt="mxfp4")
  want = quantized_grouped_matmul_reference(x, codes, scales, sizes, fmt="mxfp4")
  w = formats.dequantize(codes, scales, "mxfp4")
  assert_close_to_reference(out, want, product_bound(x, w, np.array([4, 0, 5])), 9)
  one = quantized_matmul(x, codes[0], scales[0], fmt="mxfp4")
  assert one.shape == (12, n)


def test_bad_inputs_raise_one_line_errors():
  n, k = 48, 96
  codes, scales = packed_weights(40, "int4", 2, n, k)
  x = activations(41, 8, k)
  sizes = jnp.array([4, 4], jnp.int32)
  op = functools.partial(quantized_grouped_matmul, fmt="int4")
  cases = [
      (lambda: quantized_grouped_matmul(x, codes, scales, sizes, fmt="nf4"), "unknown packed"),
      (lambda: op(x.astype(jnp.float32), codes, scales, sizes), "lhs must be bfloat16"),
      (lambda: op(x[:, :64], codes, scales, sizes), "activations have K=64"),
      (lambda: op(x, codes.astype(jnp.int8), scales, sizes), "codes must be uint8"),
      (lambda: op(x, codes, scales.astype(jnp.float32), sizes), "scales must be bfloat16"),
      (lambda: op(x, codes, scales[:, :, :2], sizes), "scales of an"),
      (lambda: op(x, codes, scales, sizes[:1]), "group_sizes has 1"),
      (lambda: op(x, codes, scales, sizes.astype(jnp.float32)), "integer"),
      (lambda: op(x[0], codes, scales, sizes), r"lhs must have shape \[M, K\]"),
      (lambda: quantized_matmul(x, codes, scales, fmt="int4"), r"codes must have shape"),
  ]
  for call, message in cases:
    with pytest.raises(ValueError, match=message) as error:
      call()
    assert "\n" not in str(error.value)
