"""The image path: a ViT encoder over square tiles, a projector into d_model, and the
placement of image tokens at their placeholder positions in the text sequence."""

from hylora.model.vision.placement import place_image_tokens
from hylora.model.vision.tower import VisionTower

__all__ = ["VisionTower", "place_image_tokens"]
