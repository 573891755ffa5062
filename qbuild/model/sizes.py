"""What a model's weights and images come to: the bytes of its weights in a dtype under an FP8 policy, of its largest
tensors and of a convert step's description, the patch tokens an image makes, and the size of the image the verify
step feeds a bundle. Planning estimates with these, the recipe checks bound with them, and the reference step draws its
image at VERIFY_IMAGE_SIZE.
"""

from __future__ import annotations

import math

from qbuild.core.dtypes import DTYPE_BYTES
from qbuild.model.arch import Arch, VisionArch
from qbuild.model.fp8 import policy as fp8_policy

# The reference's synthetic image, (height, width) in pixels: a 4 x 6 patch grid at patch 16, non-square so rows and
# columns differ.
VERIFY_IMAGE_SIZE = (64, 96)
# The pixel bounds of transformers' Qwen2-VL image processor when none are configured, which the reference and the
# runtime use (transformers/models/qwen2_vl/image_processing_pil_qwen2_vl.py, `size` @ 5.24.0).
_MIN_PIXELS, _MAX_PIXELS = 56 * 56, 28 * 28 * 1280
# A description names each source tensor and each converted one (file, names, dtype, shape, byte range): about this
# many bytes of JSON per source tensor, counting the per-expert storage form's E tensors per projection.
_DESCRIBED_BYTES_PER_TENSOR = 256


def weight_bytes(arch: Arch, dtype: str, fp8: str) -> int:
    """The bytes of the model's weights in `dtype`, its MLP weights as the FP8 policy `fp8` stores them."""
    dense, experts = arch.param_counts()
    b = DTYPE_BYTES[dtype]
    # Experts are the MLP weights of the MoE families.
    mlp_bytes = fp8_policy(fp8).mlp_bytes(b)
    if arch.is_moe:
        return dense * b + experts * mlp_bytes
    mlp = 3 * arch.hidden_size * arch.intermediate_size * arch.num_layers
    return (dense - mlp) * b + mlp * mlp_bytes


def image_patches(vision: VisionArch, height: int, width: int) -> int:
    """Patch tokens the Qwen2-VL image processor makes of one image of height x width pixels: it resizes to
    multiples of patch_size * spatial_merge_size within its pixel bounds (smart_resize in
    transformers/models/qwen2_vl/image_processing_qwen2_vl.py @ 5.24.0), then cuts patch_size squares; a still image
    is one temporal patch."""
    factor = vision.patch_size * vision.spatial_merge_size
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > _MAX_PIXELS:
        beta = math.sqrt(height * width / _MAX_PIXELS)
        h, w = max(factor, math.floor(height / beta / factor) * factor), \
            max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < _MIN_PIXELS:
        beta = math.sqrt(_MIN_PIXELS / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return (h // vision.patch_size) * (w // vision.patch_size)


def description_bytes(arch: Arch) -> int:
    """About the size of a convert step's text/description.json (qbuild.model.convert.description)."""
    return (arch.num_layers * (24 + 3 * (arch.num_experts or 0)) + 8) * _DESCRIBED_BYTES_PER_TENSOR


def largest_vision_bytes(arch: Arch) -> int:
    """The largest vision tensor in float32 (the merger's fc1, or the position embedding)."""
    v = arch.vision
    if v is None:
        return 0
    return max(v.merged_hidden_size ** 2, v.num_position_embeddings * v.hidden_size,
               v.intermediate_size * v.hidden_size) * 4


def largest_tensor_bytes(arch: Arch, dtype_bytes: int) -> int:
    emb = arch.vocab_size * arch.hidden_size
    experts = (arch.num_experts or 0) * 2 * (arch.moe_intermediate_size or 0) * arch.hidden_size
    return max(emb, experts) * dtype_bytes
