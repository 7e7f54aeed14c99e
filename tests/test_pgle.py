"""hylora.profile.pgle: profile-guided recompilation and the instruction-cost decoder."""

import struct

import jax
import jax.numpy as jnp

from hylora.profile import pgle


def _entry(name: str, cost_us: float) -> bytes:
  body = bytes([0x0A, len(name)]) + name.encode() + b"\x11" + struct.pack("<d", cost_us)
  return bytes([0x0A, len(body)]) + body


def test_instruction_costs_decode_the_profile_proto():
  # two costs (one name twice: summed) and a Latency entry (field 2) that is skipped
  latency = b"\x12\x05\x0a\x01a\x12\x00"
  profile = _entry("fusion.3", 12.5) + latency + _entry("custom-call.7", 40.0) + \
      _entry("fusion.3", 0.25)
  assert pgle.instruction_costs(profile) == {"fusion.3": 12.75, "custom-call.7": 40.0}
  assert pgle.instruction_costs(b"") == {}


def test_without_a_device_profile_the_first_compilation_is_kept():
  f = jax.jit(lambda x: jnp.sum(x @ x.T))
  x = jnp.arange(64.0).reshape(8, 8)
  compiled, profiled = pgle.compile_with_profile(f.lower(x), (x,))
  assert not profiled  # XLA:CPU records no per-instruction device times
  assert float(compiled(x)) == float(f(x))
