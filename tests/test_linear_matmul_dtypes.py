"""The frozen linears' matmuls run in bf16 both ways; the adapters' products in fp32."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.extend.core import jaxprs_in_params

from hylora.core.config import LoRAConfig
from hylora.model import LoRAParam
from hylora.model.init import ParamInit
from hylora.model.lora import Linear


def _dots(jaxpr):
  """(operand dtypes, result dtype, operand shapes) of every dot_general, nested jaxprs too."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      out.append((tuple(str(v.aval.dtype) for v in eqn.invars), str(eqn.outvars[0].aval.dtype),
                  tuple(v.aval.shape for v in eqn.invars)))
    for sub in jaxprs_in_params(eqn.params):
      out += _dots(sub)
  return out


def _layer():
  lora = LoRAConfig(rank=4, targets=("proj",))
  return Linear((64,), (48,), ("embed",), ("mlp",), name="proj", lora=lora, init=ParamInit(0),
                init_std=0.02)


def test_input_gradient_of_the_frozen_kernel_is_a_bf16_matmul():
  layer = _layer()
  graphdef, adapters, frozen = nnx.split(layer, LoRAParam, ...)
  x = jax.random.normal(jax.random.key(1), (2, 8, 64), jnp.bfloat16)

  def loss(adapters, x):
    y = nnx.merge(graphdef, adapters, frozen)(x)
    return jnp.sum(y.astype(jnp.float32) * jnp.cos(jnp.arange(48.0)))

  dots = _dots(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(adapters, x).jaxpr)
  # the products with the frozen kernel W [64, 48]: x W and the input gradient dy W^T
  kernel_dots = [d for d in dots if (64, 48) in d[2]]
  assert [d[:2] for d in kernel_dots] == [(("bfloat16", "bfloat16"), "bfloat16")] * 2, dots
  assert sorted(d[2] for d in kernel_dots) == [((2, 8, 48), (64, 48)), ((2, 8, 64), (64, 48))]
  # the adapters' products (forward, input and factor gradients) keep fp32 results
  adapter_dots = [d for d in dots if (64, 48) not in d[2]]
  assert len(adapter_dots) >= 6 and all(d[1] == "float32" for d in adapter_dots), dots


def test_bf16_result_equals_the_fp32_accumulated_rounding():
  # the bf16-out matmul accumulates in fp32 and rounds once: the values of the fp32 form
  k1, k2 = jax.random.split(jax.random.key(3))
  x = jax.random.normal(k1, (32, 4096), jnp.bfloat16)
  w = jax.random.normal(k2, (4096, 64), jnp.bfloat16)
  dims = (((1,), (0,)), ((), ()))
  direct = jax.lax.dot_general(x, w, dims)
  rounded = jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32).astype(x.dtype)
  np.testing.assert_array_equal(np.asarray(direct, np.float32), np.asarray(rounded, np.float32))
