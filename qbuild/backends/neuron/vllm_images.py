"""What vLLM's Neuron plugin does with the images of a neuron VL bundle: it cannot serve them (docs/vllm.md section 11),
so `qbuild serve --server vllm` says so beside the command (`--dry-run` included) and refuses --allow-image-urls for
such a bundle; without --server vllm a VL bundle is served by qbuild's own server, which takes images (vl_serve).

vllm-neuron 0.5.0 @ 3afb0a9 gets images to NxDI only for the architectures in NEURON_MULTI_MODAL_MODELS
(vllm_neuron/worker/constants.py:4-10: Mllama, Llava, Llama4, Qwen2-VL, Qwen3-VL): only they are loaded by its
multimodal wrappers (neuronx_distributed_model_loader.py:998-1007), which build NxDI's ImageToText application from a
text and a vision NeuronConfig (L576-631), and only they are run with their multimodal inputs (neuronx_distributed_
model_runner.py:752-761); the runner's preprocessing of those inputs knows the model types llava, qwen2_vl, qwen3_vl and
llama4 and raises for any other (L1084-1118), whatever the architecture. The Qwen3.5 ports' VL
model, NeuronQwen35VLForCausalLM, is no NxDI application at all ("NOT an NeuronBaseForImageToText subclass":
contrib/models/Qwen3.5-2B/src/modeling_qwen35_vl.py:251-265 @ 4bcdc54), so no registration a plugin can make gives
vllm-neuron a class it could load and run with images. The bundle's plugin therefore registers the text model, as
before (vllm_plugin.STAND_IN), and vLLM refuses an image part itself, with a 400: "<model> is not a multimodal model"
(vllm/multimodal/registry.py:232-233, raised from the chat parser's item tracker, entrypoints/chat_utils.py:501-503,
and answered as a 400 by entrypoints/openai/engine/serving.py:640-662 @ vLLM 0.16.0).
"""

from __future__ import annotations

from qbuild.core.errors import UserError

WHY = ("vllm-neuron 0.5 runs images only for the architectures in NEURON_MULTI_MODAL_MODELS "
       "(vllm_neuron/worker/constants.py:4-10 @ 3afb0a9) and preprocesses them only for llava, qwen2_vl, qwen3_vl and "
       "llama4 (neuronx_distributed_model_runner.py:1084-1118); the Qwen3.5 ports' VL model is no NxDI application "
       "it could load (modeling_qwen35_vl.py:251-265 @ 4bcdc54). vLLM answers an image part with a 400 (\"not a "
       "multimodal model\"); text prompts are served")
ELSEWHERE = ("`qbuild serve` of this bundle without --server vllm: qbuild's own server over the port's "
             "NeuronQwen35VLForCausalLM, which takes images (docs/vision.md section 8)")


def images_note(manifest: dict) -> dict | None:
    """The `images` entry of a VL bundle's serving document, or None for a text bundle."""
    buckets = manifest.get("buckets", {}).get("vision") or []
    if not buckets:
        return None
    return {"served": False, "vision_buckets": sorted(buckets), "why": WHY, "images_elsewhere": ELSEWHERE}


def check_image_urls(manifest: dict, allow_image_urls: bool) -> None:
    """--allow-image-urls is for a server that takes images: refused for a neuron bundle vLLM serves, in one line."""
    if allow_image_urls:
        vl = manifest.get("buckets", {}).get("vision")
        what = "this VL bundle's images" if vl else "images of this text bundle"
        instead = " (or drop --server vllm: qbuild's server takes them)" if vl else ""
        raise UserError(f"--allow-image-urls: vLLM's Neuron plugin cannot serve {what}; drop the flag{instead} "
                        "(docs/vllm.md section 11)")
