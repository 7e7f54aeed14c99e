"""The loop-over-groups stand-in (XLA:CPU) against the dequantize-then-bf16 reference,
forward and input gradient, for every format; and its memory: one group's dequantized
weight at a time, never the whole stack."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quantized_matmul import (formats, loop_quantized_grouped_matmul,
                                             loop_quantized_matmul,
                                             quantized_grouped_matmul_reference,
                                             quantized_matmul_reference)
from pallas_kernels.quantized_matmul.tests._inputs import (GROUP_SIZES, M, ROWS_IN_GROUPS, SHAPES,
                                                           activations, assert_close_to_reference,
                                                           assert_codes_covered, packed_weights,
                                                           product_bound)


@pytest.mark.parametrize("fmt_name", ["fp8_block", "mxfp4", "int4"])
def test_forward_and_input_gradient_match_reference(fmt_name):
  n, k = SHAPES[fmt_name]
  codes, scales = packed_weights(20, fmt_name, len(GROUP_SIZES), n, k)
  assert_codes_covered(codes, fmt_name)
  x, dout = activations(21, M, k), activations(22, M, n)
  sizes = jnp.asarray(GROUP_SIZES)
  w = formats.dequantize(codes, scales, fmt_name)
  op = jax.jit(lambda x: loop_quantized_grouped_matmul(x, codes, scales, sizes, fmt=fmt_name))
  out, pullback = jax.vjp(op, x)
  want, want_pullback = jax.vjp(
      lambda x: quantized_grouped_matmul_reference(x, codes, scales, sizes, fmt=fmt_name), x)
  assert out.dtype == jnp.bfloat16
  assert_close_to_reference(out, want, product_bound(x, w, GROUP_SIZES), ROWS_IN_GROUPS)
  (dx,), (want_dx,) = pullback(dout), want_pullback(dout)
  assert dx.dtype == jnp.bfloat16
  assert_close_to_reference(dx, want_dx, product_bound(dout, w, GROUP_SIZES, transpose=True),
                            ROWS_IN_GROUPS)


@pytest.mark.parametrize("fmt_name", ["mxfp4", "fp8_block"])
def test_single_matrix_over_leading_dims(fmt_name):
  n, k = SHAPES[fmt_name]
  codes, scales = packed_weights(23, fmt_name, 1, n, k)
  x = activations(24, 6, k).reshape(2, 3, k)
  out = loop_quantized_matmul(x, codes[0], scales[0], fmt=fmt_name)
  want = quantized_matmul_reference(x, codes[0], scales[0], fmt=fmt_name)
  assert out.shape == (2, 3, n)
  w = formats.dequantize(codes, scales, fmt_name)
  bound = product_bound(x.reshape(6, k), w, np.array([6]))
  assert_close_to_reference(out.reshape(6, n), want.reshape(6, n), bound, 6)


def test_dequantizes_one_group_at_a_time():
  g, n, k = 8, 64, 256
  codes, scales = packed_weights(25, "int4", g, n, k)
  x = activations(26, 40, k)
  sizes = jnp.array([5] * g, jnp.int32)
  grad = jax.jit(
      jax.grad(lambda x: jnp.sum(
          loop_quantized_grouped_matmul(x, codes, scales, sizes, fmt="int4").astype(jnp.float32))))
  text = grad.lower(x).compile().as_text()
  assert f"bf16[{n},{k}]" in text  # one group's weight ...
  assert f"bf16[{g},{n},{k}]" not in text and f"f32[{g},{n},{k}]" not in text  # ... never all
