"""Which vision bucket an image runs through, and when it is cut into 2x2 tiles: the rule the Qwen3.5 VL ports apply
(docs/vision.md section 2), as plain arithmetic on the image's patch grid, shared by the CPU runtime (which encodes
the image) and the neuron package step (which records what the port will do with the bundle's encoders). No torch.

NeuronQwen35VisionModelWrapper.forward (contrib/models/Qwen3.5-2B/src/modeling_qwen35_vision.py:786-806 @ 4bcdc54,
the 35B-A3B copy alike) runs an image of N patch tokens through the smallest compiled bucket that holds it; where N
exceeds the largest bucket B it tiles when the input is one image whose patch grid has even height and width and
N / 4 <= B (`can_tile`), and `_tiled_forward` (L902-961) then asserts a still image (t == 1) and a height and width
divisible by 2 * spatial_merge_size. qbuild takes the two conditions together and refuses, in one line, the images the
port would assert on; each tile (H/2 x W/2 patches) runs through the smallest bucket that holds it.
"""

from __future__ import annotations

from dataclasses import dataclass

TILES = 2   # tiles per side: 2x2


@dataclass(frozen=True)
class ImagePlan:
    """How one image of grid (t, h, w) patches is encoded: through `bucket`, whole or as 2x2 tiles."""

    bucket: int
    tiled: bool

    @property
    def calls(self) -> int:
        """Encoder calls the image takes."""
        return TILES * TILES if self.tiled else 1


class ImageTooLarge(ValueError):
    """An image no bucket holds, whole or tiled; the message says which limit it passes."""


def largest_patches(buckets: list[int] | tuple[int, ...]) -> int:
    """The most patch tokens an image may have: four tiles of the largest bucket."""
    return TILES * TILES * max(buckets)


def plan_image(grid: tuple[int, int, int], buckets: list[int] | tuple[int, ...], merge: int) -> ImagePlan:
    """The smallest bucket holding an image of `grid` = (t, h, w) patches, or, past the largest, its tiles' bucket.
    ImageTooLarge where neither holds it, or where the port could not tile it."""
    t, h, w = grid
    num = t * h * w
    ordered = sorted(buckets)
    fits = [b for b in ordered if b >= num]
    if fits:
        return ImagePlan(fits[0], tiled=False)
    largest = ordered[-1]
    if num > TILES * TILES * largest:
        raise ImageTooLarge(f"{num} patch tokens ({h}x{w} patches), more than four tiles of the largest vision bucket "
                            f"{largest} hold ({TILES * TILES * largest})")
    side = TILES * merge
    if t != 1 or h % side or w % side:
        raise ImageTooLarge(f"{num} patch tokens ({h}x{w} patches), more than the largest vision bucket {largest}, "
                            f"and not cut into 2x2 tiles: the port tiles a still image whose patch rows and columns "
                            f"are multiples of {side}")
    tile = num // (TILES * TILES)
    return ImagePlan(next(b for b in ordered if b >= tile), tiled=True)


def tile_grid(grid: tuple[int, int, int]) -> tuple[int, int, int]:
    """The patch grid of each tile of a tiled image."""
    t, h, w = grid
    return t, h // TILES, w // TILES
