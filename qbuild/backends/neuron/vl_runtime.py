"""A neuron VL bundle loaded to answer qbuild's OpenAI server (qbuild.backends.openai_server.runtime.ServingRuntime)
through the port's own VL classes, as the port's VL benchmark loads and runs them (contrib/models/Qwen3.5-2B/test/
integration/run_vl_benchmark.py @ 4bcdc54; the 35B-A3B copy is the same code; docs/vision.md section 8):

- the text model: `NeuronQwen35VLForCausalLM(model_path, text_config, vision_config=vl_config)` (L119-123), its
  `text_model.load(<compiled dir>)` (L124) on the bundle root, NxDI's compiled directory. text_config is built as the
  compile built it (sdk_worker.text_config over the bundle's qbuild-neuron.json), as the benchmark builds the one it
  compiled with (L43-84), and compared with the one the compile saved before the text model loads
  (check_compiled_config); vl_config is `Qwen35VLInferenceConfig` over the checkpoint's vision_config and token ids
  (L86-98);
- the vision encoders: `vision_model_wrapper.load_compiled(<dir>)` (L130) on the bundle root, which holds
  `vision_encoder_<b>.pt` or `bucket_<b>/tp_*.pt` per bucket, and `load_vision_weights_from_hf(<dir>)` (L131) on the
  bundle's vision/host/ (package.VISION_HOST). No CPU encoder is loaded (the benchmark's L133): qbuild refuses an image
  no compiled bucket takes, whole or as 2x2 tiles (qbuild.model.tiling), before it reaches the port;
- a generation: `generate(input_ids, attention_mask, pixel_values, image_grid_thw, max_new_tokens, temperature=0.0,
  eos_token_ids)` (L148-167), which computes the mRoPE positions, runs the wrapper (tiling as the port tiles: its
  forward, modeling_qwen35_vision.py:771-806), pads the image features to the text model's inputs and runs context
  encoding then token generation (modeling_qwen35_vl.py:363-603). The image's patches come from the checkpoint's own
  processor settings, as the benchmark's AutoProcessor (L207-210) reads them (qbuild.model.runtime.images). A prompt
  without an image is given the image path's padding inputs at its context encoding, where the port would give it
  none and its text model would then zero the prompt's last token (sdk_worker.padding_slot_vision_inputs).

The port's generate returns only when it is done. Each token it chooses is fed back as the next decode call's input
(L582-595), so the text model is watched while generate runs (TokenWatch): a token reaches the server as soon as the
port asks for the next one, and a stopped request ends before the next decode.

Imports the Neuron SDK and the port; runs inside `python -m qbuild.backends.neuron.vl_serve` (its environment made of
the bundle's record, the port on sys.path).
"""

from __future__ import annotations

import importlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from qbuild.backends.neuron.config import inference_kwargs
from qbuild.backends.neuron.driver import QBUILD_RECORD
from qbuild.backends.neuron.package import HOST_TENSORS, VISION_HOST
from qbuild.backends.neuron.params import NeuronTextCompile
from qbuild.backends.neuron.ports import LINEAGES
from qbuild.core.errors import UserError
from qbuild.model.runtime.prompts import PromptRules
from qbuild.recipe.params import ParamsError, parse

VL_MODULE = "src.modeling_qwen35_vl"                 # modeling_qwen35_vl.py @ 4bcdc54 (main lineage, both ports)
VL_CLASS = "NeuronQwen35VLForCausalLM"               # L251
VL_CONFIG_CLASS = "Qwen35VLInferenceConfig"          # L211


@dataclass
class VLGeneration:
    token_ids: list[int]
    text: str
    cached_tokens: int = 0           # no prefix cache


class Stopped(Exception):
    """The request whose tokens a TokenWatch reports asked to stop."""


class TokenWatch:
    """Stands in for the port's text model while its generate runs: calls go through unchanged, and each decode call's
    input token, the token generate chose before it, is reported first. `on_token` returning true raises Stopped
    before that decode runs. `prefill_inputs`, where given, are the llava_args the context encoding takes when
    generate passes none (a text-only prompt: sdk_worker.padding_slot_vision_inputs)."""

    def __init__(self, model, on_token: Callable[[int], bool | None] | None, prefill_inputs: list | None = None):
        self.model, self.on_token, self.tokens = model, on_token, []
        self.prefill_inputs = prefill_inputs
        self._decoding = False

    def reset(self) -> None:
        self._decoding = False
        self.model.reset()

    def __call__(self, *args, **kwargs):
        if self._decoding:
            self.report(int(kwargs["input_ids"][0, -1]))
        elif self.prefill_inputs is not None and not kwargs.get("llava_args"):
            kwargs["llava_args"] = self.prefill_inputs
        self._decoding = True
        return self.model(*args, **kwargs)

    def report(self, token: int) -> None:
        self.tokens.append(token)
        if self.on_token is not None and self.on_token(token):
            raise Stopped()

    def __getattr__(self, name):
        return getattr(self.model, name)


class Images:
    """What the server takes as an image: the checkpoint's processor (its preprocessor_config.json, read lazily) and
    the bundle's vision buckets, which an image must fit whole or as 2x2 tiles."""

    def __init__(self, root: Path, vision_config: dict, buckets: list[int]):
        self.root, self.vision_config, self.buckets = root, vision_config, buckets
        self._processor = None

    def prepare(self, image, label: str | None = None):
        from qbuild.model.runtime.images import image_processor, prepare

        if self._processor is None:
            self._processor = image_processor(self.root, self.vision_config)
        return prepare(self._processor, image, self.buckets, self.vision_config.get("spatial_merge_size", 2), label)


class NeuronVLRuntime(PromptRules):
    def __init__(self, root: Path, config: dict, tokenizer, arch, cte: list[int], tkg: list[int], vl, images: Images,
                 text_prompt_dummy: str):
        self.root, self.config, self.tokenizer, self.arch = root, config, tokenizer, arch
        self.cte, self.tkg, self.vl, self.vision = cte, tkg, vl, images
        self.text_prompt_dummy = text_prompt_dummy

    @classmethod
    def load(cls, bundle: Path) -> "NeuronVLRuntime":
        """The bundle's text model and vision encoders loaded through the port's VL classes on this host's
        NeuronCores, as the port's VL benchmark loads them (see the module's docstring)."""
        from transformers import AutoTokenizer

        from qbuild.backends.neuron.sdk_worker import text_config
        from qbuild.model.arch import arch_from_config

        record = json.loads((bundle / QBUILD_RECORD).read_text())
        try:
            params = parse(NeuronTextCompile, record["params"], "params")
        except ParamsError as e:
            raise UserError(f"{bundle / QBUILD_RECORD}: does not record the neuron text compile this runtime loads "
                            f"({e})") from None
        cfg = record["config"]
        config = json.loads((bundle / "config.json").read_text())
        vision = json.loads((bundle / "qbuild-vision.json").read_text())
        port = LINEAGES[cfg["lineage"]].module_dir(bundle / "port")
        sys.path.insert(0, str(port))
        text_module = importlib.import_module(cfg["module"])
        vl_module = importlib.import_module(VL_MODULE)
        text = text_config(text_module, cfg, inference_kwargs(params))
        vl = getattr(vl_module, VL_CLASS)(model_path=str(bundle), text_config=text,
                                          vision_config=vl_config(vl_module, text, config))
        check_compiled_config(bundle, text)
        vl.text_model.load(str(bundle))
        vl.vision_model_wrapper.load_compiled(str(bundle))
        vl.vision_model_wrapper.load_vision_weights_from_hf(str(bundle / VISION_HOST))
        check_host_weights(bundle, vl.vision_model_wrapper)
        return cls(bundle, config, AutoTokenizer.from_pretrained(str(bundle)), arch_from_config(config),
                   sorted(params.cte_buckets), sorted(params.tkg_buckets), vl,
                   Images(bundle, config["vision_config"], vision["buckets"]),
                   LINEAGES[cfg["lineage"]].text_prompt_dummy)

    def prepare_image(self, image, label: str | None = None):
        return self.vision.prepare(image, label)

    @property
    def max_prompt_tokens(self) -> int:
        """The largest context-encoding bucket less one token: a prompt of its whole length has its last token in the
        slot every padding row of the vision inputs is written to, and loses its embedding, with or without an image
        (docs/vision.md section 8)."""
        return self.cte[-1] - 1

    def check_prompt(self, n: int) -> int:
        if n == self.cte[-1]:
            raise UserError(f"the prompt has {n} tokens, as many as the largest context-encoding bucket of this "
                            f"bundle, where the port's text model overwrites the last one's embedding (docs/vision.md "
                            f"section 8); send at most {n - 1}")
        return super().check_prompt(n)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, *, prepared=None,
                 on_token: Callable[[int], bool | None] | None = None) -> VLGeneration:
        """Greedy tokens from the port's generate (temperature 0.0, its argmax of returned logits, or the compiled
        sampler's token: modeling_qwen35_vl.py:530-561, 605-619), ending at the bundle's end-of-sequence tokens."""
        import torch

        from qbuild.backends.neuron.sdk_worker import padding_slot_vision_inputs

        self.check_image_tokens(prompt_ids, prepared)
        self.check_lengths(len(prompt_ids), max_new_tokens)
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        # The port's generate passes a text-only prompt no llava_args, and its text model then zeroes the prompt's
        # last token on a graph traced with vision inputs; the image path's padding convention sends that scatter
        # to a padding slot (sdk_worker.padding_slot_vision_inputs, docs/vision.md section 8).
        watch = TokenWatch(self.vl.text_model, on_token,
                           padding_slot_vision_inputs(self.vl.text_model.config, 1, self.text_prompt_dummy)
                           if prepared is None else None)
        self.vl.text_model = watch
        try:
            out = self.vl.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                   pixel_values=prepared.pixel_values if prepared is not None else None,
                                   image_grid_thw=prepared.grid if prepared is not None else None,
                                   max_new_tokens=max_new_tokens, temperature=0.0, eos_token_ids=self.eos_ids())
            tokens = out[0, len(prompt_ids):].tolist()
            for token in tokens[len(watch.tokens):]:     # the last, which no decode call was fed
                watch.report(int(token))
        except Stopped:
            pass
        finally:
            self.vl.text_model = watch.model
        tokens = watch.tokens
        return VLGeneration(tokens, self.tokenizer.decode(tokens, skip_special_tokens=True))


# The fields of the text config that say how the compiled graphs are called and what they return.
COMPILED_FIELDS = (("neuron_config", "tp_degree"), ("neuron_config", "batch_size"), ("neuron_config", "seq_len"),
                   ("neuron_config", "max_context_length"), ("neuron_config", "context_encoding_buckets"),
                   ("neuron_config", "token_generation_buckets"), ("neuron_config", "on_device_sampling_config"),
                   ("use_text_only_cte_inputs",))


def check_compiled_config(bundle: Path, text) -> None:
    """UserError naming the first of COMPILED_FIELDS where `text`, the config this qbuild rebuilt from the bundle's
    record, differs from the one the compile saved (NxDI's neuron_config.json, `to_dict` of the config: models/config.py
    L62-77, L927-944 @ ef2731e). NxDI runs the graphs with whatever config it is given and checks it against nothing
    (NeuronApplicationBase.__init__, application_base.py L73-90): tokens would be read as logits, or a context
    encoding traced with vision inputs called without them. The saved config is not loaded instead, because the
    ports' get_neuron_config_cls returns NeuronConfig even for MoE (2B modeling_qwen35.py L2352-2353, 35B-A3B
    L2446-2453 @ 4bcdc54), so InferenceConfig.load would drop the MoE fields (config.py L987-991)."""
    from neuronx_distributed_inference.models.config import to_dict

    path = bundle / "neuron_config.json"
    saved = json.loads(path.read_text())
    built = json.loads(json.dumps(to_dict(text)))
    for keys in COMPILED_FIELDS:
        was, now = saved, built
        for key in keys:
            was = was.get(key) if isinstance(was, dict) else None
            now = now.get(key) if isinstance(now, dict) else None
        if isinstance(was, dict) and isinstance(now, dict):
            # SDK releases add fields (OnDeviceSamplingConfig.sampling_dp_degree from 2.28): those both know decide.
            was, now = ({k: d[k] for k in sorted(was.keys() & now.keys())} for d in (was, now))
        if was != now:
            raise UserError(f"{path}: {'.'.join(keys)} is {json.dumps(was)} there, and {json.dumps(now)} in the config "
                            f"this qbuild builds from {QBUILD_RECORD}: the bundle was compiled by a qbuild or Neuron "
                            "SDK that builds it otherwise; serve it with those, or build it again")


def vl_config(vl_module, text, config: dict):
    """Qwen35VLInferenceConfig as run_vl_benchmark.py L86-98 builds it: the checkpoint's vision_config (merge and
    temporal patch sizes defaulted to 2) and its image, video and vision start / end token ids."""
    vision = dict(config["vision_config"])
    vision.setdefault("spatial_merge_size", 2)
    vision.setdefault("temporal_patch_size", 2)
    ids = {k: config[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
           if config.get(k) is not None}
    return getattr(vl_module, VL_CONFIG_CLASS)(text_config=text, vision_config=vision,
                                               spatial_merge_size=vision["spatial_merge_size"], **ids)


def check_host_weights(bundle: Path, wrapper) -> None:
    """The wrapper holds the bundle's patch and position embeddings: load_vision_weights_from_hf copies only the keys
    it finds and says nothing where it finds none (modeling_qwen35_vision.py:531-555), which would leave them as
    initialised, so what it holds is compared with the file."""
    import torch
    from safetensors.torch import load_file

    path = bundle / VISION_HOST / "model.safetensors"
    tensors = load_file(path)
    held = {"model.visual.patch_embed.proj.weight": wrapper.patch_embed.proj.weight,
            "model.visual.patch_embed.proj.bias": wrapper.patch_embed.proj.bias,
            "model.visual.pos_embed.weight": wrapper.pos_embed.weight}
    for name in HOST_TENSORS.values():
        if name not in tensors or not torch.equal(held[name].detach().to(tensors[name].dtype), tensors[name]):
            raise UserError(f"{path}: the port's vision wrapper did not load {name} from it")
