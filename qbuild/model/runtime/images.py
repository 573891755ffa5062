"""The host side of a VL bundle: an image file -> patches (the HF Qwen2-VL processor's pixel layout) -> the
vision graph of the smallest bucket that fits -> merged features for the image-pad tokens."""

from __future__ import annotations

import json
from pathlib import Path

from qbuild.model.arch import Arch, ConfigError
from qbuild.core.errors import UserError

# The Qwen3.5 processors' normalisation when a checkpoint carries no preprocessor_config.json.
DEFAULT_MEAN_STD = ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])


def image_processor(root: Path, vision_config: dict):
    """The checkpoint's image processor settings (preprocessor_config.json if present) on the PIL backend."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    pre = root / "preprocessor_config.json"
    saved = json.loads(pre.read_text()) if pre.exists() else {}
    mean, std = DEFAULT_MEAN_STD
    return Qwen2VLImageProcessorPil(
        patch_size=vision_config.get("patch_size", 16), temporal_patch_size=vision_config.get("temporal_patch_size", 2),
        merge_size=vision_config.get("spatial_merge_size", 2), image_mean=saved.get("image_mean", mean),
        image_std=saved.get("image_std", std))


# The most pixels an image may have to be decoded. The processor scales every image down to at most 28*28*1280
# pixels (about 1 MP, transformers' Qwen2-VL default) before the encoder sees it, so a larger picture only costs
# memory: 64 MP is ~200 MB decoded as RGB. PIL's own default (89 MP, a warning only, an error at twice that) is not
# relied on: a small PNG can declare billions of pixels (a decompression bomb).
MAX_IMAGE_PIXELS = 8192 * 8192


def _open(image: Path):
    """The image file opened (its header read, nothing decoded), refused when it is not an image or declares more than
    MAX_IMAGE_PIXELS pixels."""
    import warnings

    from PIL import Image

    Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS   # PIL checks it when opening and again when decoding
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(image)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise _too_large(image, str(e)) from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:   # PIL's plugins raise these on corrupt headers
        raise UserError(f"{image}: cannot read the image: {e}") from None
    width, height = img.size
    if width * height > MAX_IMAGE_PIXELS:   # formats whose size PIL learns only when decoding
        img.close()
        raise _too_large(image, f"{width}x{height}")
    return img


def _too_large(image: Path, size: str) -> UserError:
    import re

    declared = re.search(r"\((\d+) pixels\)", size)   # PIL's message: "Image size (N pixels) exceeds limit ..."
    size = f"{declared[1]} pixels" if declared else f"{size} pixels"
    return UserError(f"{image}: the image declares {size}, more than the {MAX_IMAGE_PIXELS} (8192x8192) qbuild "
                     "decodes (a decompression bomb, or a picture to scale down first); refusing to decode it")


def check_image(image: Path) -> None:
    """Refuse an image file `pixels` would refuse, reading only its header (before a bundle is loaded for it)."""
    _open(image).close()


def pixels(processor, image: Path):
    """(pixel_values (N, C*T*P*P), grid_thw (1, 3)) of one image file."""
    import warnings
    import zlib

    from PIL import Image

    try:
        with _open(image) as img, warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            rgb = img.convert("RGB")
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise _too_large(image, str(e)) from None
    except (OSError, ValueError, SyntaxError, EOFError, zlib.error) as e:
        raise UserError(f"{image}: cannot read the image: {e}") from None
    out = processor(images=[rgb], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


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

    def encode(self, image: Path, buckets: list[int], graph):
        """-> (features (merged tokens, out_hidden), grid_thw (1, 3)) through the smallest fitting bucket."""
        import torch

        pixel_values, grid = pixels(self.processor, image)
        num = int(grid.prod())
        fits = [b for b in buckets if b >= num]
        if not fits:
            raise UserError(f"{image}: {num} patch tokens, more than the largest vision bucket {buckets[-1]} of this "
                            "bundle; use a smaller image or build a recipe with a larger vision bucket")
        hidden, mask, cos, sin, keep = self.host.prepare(pixel_values, grid, fits[0])
        with torch.no_grad():
            features = graph(f"vision-{fits[0]}")(self.weights, hidden, mask, cos, sin)
        return features[:keep], grid
