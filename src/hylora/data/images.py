"""Images -> fixed-size square tiles for the vision encoder.

An image up to `max_image_side` pixels a side is resized onto a grid of r x c tiles
(r * c <= max_tiles, no more tiles than its own size calls for, the grid whose shape is
closest to the image's); a grid of more than one tile is preceded by a thumbnail tile of
the whole image, so the model sees both the overview and the detail.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from hylora.core.config import VisionConfig
from hylora.core.errors import DataError


def choose_grid(width: int, height: int, tile: int, max_tiles: int) -> tuple[int, int]:
  """(rows, cols) of the tile grid for an image of width x height pixels."""
  wanted = max(1, min(max_tiles, math.ceil(width / tile) * math.ceil(height / tile)))
  aspect = math.log(width / height)
  grids = [(r, c) for r in range(1, wanted + 1) for c in range(1, wanted // r + 1)]
  # Closest aspect ratio first; among equals the larger grid (more detail).
  return min(grids, key=lambda g: (round(abs(math.log(g[1] / g[0]) - aspect), 9), -g[0] * g[1]))


def tile_count(width: int, height: int, vision: VisionConfig) -> int:
  rows, cols = choose_grid(width, height, vision.image_size, vision.max_tiles)
  return rows * cols + (1 if rows * cols > 1 else 0)


def to_tiles(image: Image.Image, vision: VisionConfig) -> np.ndarray:
  """RGB image -> [tiles, S, S, 3] uint8 (thumbnail first when there is a grid)."""
  s = vision.image_size
  rows, cols = choose_grid(image.width, image.height, s, vision.max_tiles)
  grid = np.asarray(image.resize((cols * s, rows * s), Image.Resampling.BICUBIC))
  tiles = grid.reshape(rows, s, cols, s, 3).transpose(0, 2, 1, 3, 4).reshape(-1, s, s, 3)
  if rows * cols > 1:
    thumb = np.asarray(image.resize((s, s), Image.Resampling.BICUBIC))
    tiles = np.concatenate([thumb[None], tiles])
  return np.ascontiguousarray(tiles, np.uint8)


def load_tiles(path: str, vision: VisionConfig, where: str) -> np.ndarray:
  """The tiles of the image at `path`; a DataError naming the record on any defect."""
  if not Path(path).is_file():
    raise DataError(f"{where}: image {path} does not exist")
  try:
    with Image.open(path) as image:
      width, height = image.size  # read from the header: nothing decoded yet
      if max(width, height) > vision.max_image_side:
        raise DataError(f"{where}: image {path} is {width}x{height}, larger than "
                        f"model.vision.max_image_side={vision.max_image_side}")
      rgb = image.convert("RGB")
  except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
    raise DataError(f"{where}: image {path} cannot be read ({type(e).__name__}: {e})") from None
  return to_tiles(rgb, vision)
