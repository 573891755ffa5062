"""The host side of a VL bundle: an image (a file, or the bytes of one a request carried) -> patches (the HF Qwen2-VL
processor's pixel layout, with the checkpoint's own processor settings) -> the vision graph of the smallest bucket that
fits, or four 2x2 tiles through the largest as the VL ports do (qbuild.model.tiling) -> merged features for the
image-pad tokens.

Every image passes the same limits wherever it comes from (`qbuild run --image`, a chat request): at most
MAX_IMAGE_BYTES encoded, MAX_IMAGE_PIXELS declared and sides in a ratio of at most MAX_ASPECT_RATIO (the processor's
own bound), checked before anything is decoded.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

from qbuild.model.arch import Arch, ConfigError
from qbuild.model.tiling import ImagePlan, ImageTooLarge, plan_image, tile_grid
from qbuild.core.errors import UserError

# The Qwen3.5 processors' normalisation when a checkpoint carries no preprocessor_config.json.
DEFAULT_MEAN_STD = ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])

# The most pixels an image may have to be decoded: 64 MP is ~200 MB decoded as RGB. PIL's own default (89 MP, a
# warning only, an error at twice that) is not relied on: a small PNG can declare billions of pixels (a decompression
# bomb). The processor then scales the image within its checkpoint's pixel bounds (preprocessor_config.json `size`).
MAX_IMAGE_PIXELS = 8192 * 8192
# The most bytes an encoded image may have: a 2048x2048 photograph, the largest image the validated configurations
# run (tiled), is 1-3 MB as JPEG and 5-12 MB as PNG. A server's request limit grows by this much, base64-encoded
# (qbuild.backends.openai_server.serve).
MAX_IMAGE_BYTES = 16 << 20
# The longest side over the shortest the Qwen2-VL image processor takes: transformers' `smart_resize`
# (models/qwen2_vl/image_processing_qwen2_vl.py, the processor the runtime and the reference step build) raises a
# ValueError for more, after the image is decoded. Checked from the header instead, so such an image is refused in one
# line naming it, as the size limits are.
MAX_ASPECT_RATIO = 200

ImageSource = Path | bytes   # an image file, or the encoded bytes of one


@dataclass(frozen=True)
class PreparedImage:
    """One image cut into patches, before its encoder runs: pixel_values (N, C*T*P*P), its patch grid (1, 3) (the
    mRoPE positions are the whole image's, tiled or not), the bucket it runs through and whether as 2x2 tiles."""

    pixel_values: object
    grid: object
    plan: ImagePlan
    merge: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(int(x) for x in self.grid[0])

    @property
    def tokens(self) -> int:
        """The image's merged tokens, its <|image_pad|> tokens in the prompt."""
        t, h, w = self.shape
        return t * h * w // self.merge ** 2


@dataclass(frozen=True)
class EncodedImage:
    """One image through the vision graphs: merged features (M, out_hidden) in the order of its M image tokens, and
    its patch grid (1, 3)."""

    features: object
    grid: object


def image_processor(root: Path, vision_config: dict):
    """The checkpoint's image processor (its preprocessor_config.json where it has one: normalisation and pixel bounds,
    as transformers' AutoImageProcessor reads them) on the PIL backend, with the vision encoder's patch sizes."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    pre = root / "preprocessor_config.json"
    saved = json.loads(pre.read_text()) if pre.exists() else {}
    mean, std = DEFAULT_MEAN_STD
    bounds = {k: saved[k] for k in ("size", "min_pixels", "max_pixels") if saved.get(k) is not None}
    return Qwen2VLImageProcessorPil(
        patch_size=vision_config.get("patch_size", 16), temporal_patch_size=vision_config.get("temporal_patch_size", 2),
        merge_size=vision_config.get("spatial_merge_size", 2), image_mean=saved.get("image_mean", mean),
        image_std=saved.get("image_std", std), **bounds)


def _name(image: ImageSource) -> str:
    return str(image) if isinstance(image, Path) else "the image"


def _read(image: ImageSource, label: str) -> io.BytesIO:
    """The encoded image, refused where it has more than MAX_IMAGE_BYTES bytes."""
    if isinstance(image, Path):
        try:
            size = image.stat().st_size
            if size <= MAX_IMAGE_BYTES:
                return io.BytesIO(image.read_bytes())
        except OSError as e:
            raise UserError(f"{label}: cannot read the image: {e.strerror}") from None
    else:
        size = len(image)
        if size <= MAX_IMAGE_BYTES:
            return io.BytesIO(image)
    raise UserError(f"{label}: the image is {size} bytes, more than the {MAX_IMAGE_BYTES} "
                    f"({MAX_IMAGE_BYTES >> 20} MiB) qbuild reads; scale it down or compress it first")


def _open(image: ImageSource, label: str):
    """The image opened (its header read, nothing decoded), refused when it is not an image or declares more than
    MAX_IMAGE_PIXELS pixels."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS   # PIL checks it when opening and again when decoding
    data = _read(image, label)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(data)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise _too_large(label, str(e)) from None
    except UnidentifiedImageError:   # its message holds the repr of the stream it read
        raise UserError(f"{label}: cannot read the image: its bytes are not an image format Pillow reads (PNG, JPEG, "
                        "WebP, GIF, BMP, TIFF, ...)") from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:   # PIL's plugins raise these on corrupt headers
        raise UserError(f"{label}: cannot read the image: {e}") from None
    width, height = img.size
    if width * height > MAX_IMAGE_PIXELS:   # formats whose size PIL learns only when decoding
        img.close()
        raise _too_large(label, f"{width}x{height}")
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        img.close()
        raise UserError(f"{label}: the image is {width}x{height} pixels, its sides in a ratio of "
                        f"{max(width, height) / min(width, height):.4g} to 1, more than the {MAX_ASPECT_RATIO} to 1 "
                        "the Qwen VL image processor takes; crop or pad it first")
    return img


def _too_large(label: str, size: str) -> UserError:
    import re

    declared = re.search(r"\((\d+) pixels\)", size)   # PIL's message: "Image size (N pixels) exceeds limit ..."
    size = f"{declared[1]} pixels" if declared else f"{size} pixels"
    return UserError(f"{label}: the image declares {size}, more than the {MAX_IMAGE_PIXELS} (8192x8192) qbuild "
                     "decodes (a decompression bomb, or a picture to scale down first); refusing to decode it")


def check_image(image: ImageSource, label: str | None = None) -> None:
    """Refuse an image `pixels` would refuse for its size, reading only its header (before a bundle is loaded for
    it)."""
    _open(image, label or _name(image)).close()


def pixels(processor, image: ImageSource, label: str | None = None):
    """(pixel_values (N, C*T*P*P), grid_thw (1, 3)) of one image."""
    import warnings
    import zlib

    from PIL import Image

    label = label or _name(image)
    try:
        with _open(image, label) as img, warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            rgb = img.convert("RGB")
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise _too_large(label, str(e)) from None
    except (OSError, ValueError, SyntaxError, EOFError, zlib.error) as e:
        raise UserError(f"{label}: cannot read the image: {e}") from None
    out = processor(images=[rgb], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def prepare(processor, image: ImageSource, buckets: list[int], merge: int, label: str | None = None) -> PreparedImage:
    """An image's patches and the bucket it runs through: the smallest that holds it, or the one that holds a tile of
    it cut 2x2 (qbuild.model.tiling); UserError naming the image where neither does."""
    label = label or _name(image)
    pixel_values, grid = pixels(processor, image, label)
    try:
        plan = plan_image(tuple(int(x) for x in grid[0]), buckets, merge)
    except ImageTooLarge as e:
        raise UserError(f"{label}: {e}; use a smaller image or build a recipe with a larger vision bucket") from None
    return PreparedImage(pixel_values, grid, plan, merge)


class VisionRuntime:
    def __init__(self, host, weights: dict, root: Path, vision_config: dict):
        self.host, self.weights = host, weights
        self._root, self._vision_config, self._processor = root, vision_config, None

    @property
    def processor(self):
        if self._processor is None:  # importing transformers' image processing takes seconds: only for images
            self._processor = image_processor(self._root, self._vision_config)
        return self._processor

    @classmethod
    def load(cls, root: Path, arch: Arch, config: dict, dtype) -> "VisionRuntime":
        """The bundle's vision side; a ConfigError unless its config.json (read into `arch`) has a vision encoder
        and the image token ids a prompt with an image needs."""
        from safetensors.torch import load_file

        from qbuild.model.modeling.vision import VisionHost

        origin = "config.json"
        if arch.vision is None:
            raise ConfigError(origin, "vision_config", f"model_type {config.get('model_type')!r} has no vision "
                                                       "encoder (no vision_config)")
        for key in ("image_token_id", "vision_start_token_id"):
            if getattr(arch, key) is None:
                raise ConfigError(origin, key, f"{key} is missing (the vision encoder needs it)")
        tensors = load_file(root / "vision" / "model.safetensors")
        host = VisionHost(arch, dtype)
        host_names = set(host.state_dict())
        try:
            host.load_state_dict({n: t for n, t in tensors.items() if n in host_names}, strict=True)
        except RuntimeError as e:
            raise UserError(f"{root / 'vision' / 'model.safetensors'}: {e}") from None
        weights = {n: t for n, t in tensors.items() if n not in host_names}
        return cls(host, weights, root, config["vision_config"])

    def prepare(self, image: ImageSource, buckets: list[int], label: str | None = None) -> PreparedImage:
        return prepare(self.processor, image, buckets, self.host.vision.spatial_merge_size, label)

    def run(self, image: PreparedImage, graph) -> EncodedImage:
        """The image through the vision graph of its bucket, whole or tile by tile (the tiles' features stitched back
        in the image's token order)."""
        from qbuild.model.modeling.vision import split_tiles, stitch_tiles

        if not image.plan.tiled:
            return EncodedImage(self._run(image.pixel_values, image.grid, image.plan.bucket, graph), image.grid)
        tile = image.grid.new_tensor([tile_grid(image.shape)])
        parts = [self._run(p, tile, image.plan.bucket, graph) for p in split_tiles(image.pixel_values, image.shape)]
        return EncodedImage(stitch_tiles(parts, image.shape, image.merge), image.grid)

    def _run(self, pixel_values, grid, bucket: int, graph):
        """The patches of one image (or tile) of `grid` through the vision graph of `bucket`, padding dropped."""
        import torch

        hidden, mask, cos, sin, keep = self.host.prepare(pixel_values, grid, bucket)
        with torch.no_grad():
            return graph(f"vision-{bucket}")(self.weights, hidden, mask, cos, sin)[:keep]
