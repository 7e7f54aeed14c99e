"""Mesh construction and the logical-to-mesh sharding rules."""

from meshes.mesh import AXES, build_mesh, ensure_cpu_devices
from meshes.rules import (ACTIVATION_RULES, PARAM_RULES, activation_mesh, constrain,
                          logical_to_spec, state_shardings)

__all__ = [
    "AXES", "build_mesh", "ensure_cpu_devices", "ACTIVATION_RULES", "PARAM_RULES",
    "activation_mesh", "constrain", "logical_to_spec", "state_shardings"
]
