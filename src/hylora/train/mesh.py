"""The run's device mesh from its `MeshConfig`: a shape the devices cannot hold is a
`ConfigError` naming the field, like every other bad setting."""

from __future__ import annotations

import jax

from hylora.core.config import MeshConfig
from hylora.core.errors import ConfigError
from meshes.mesh import MeshShapeError, build_mesh


def run_mesh(cfg: MeshConfig, devices=None) -> jax.sharding.Mesh:
  try:
    return build_mesh(cfg, devices)
  except MeshShapeError as e:
    raise ConfigError(str(e)) from None
