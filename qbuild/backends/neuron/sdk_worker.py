"""The part of the neuron backend that runs inside the Neuron SDK, one operation per fresh interpreter.

    python -m qbuild.backends.neuron.sdk_worker {text|vision|verify} REQUEST.json RESULT.json

qbuild.backends.neuron.driver prepares each request (pure data: the NxDI configuration, the flattened text config,
the port directory) and sets the environment NxD reads at import; this module only calls the SDK and the port with it.
Every call is the one the public ports make (cited per function); nothing here is imported by the planner.
"""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

from qbuild.core import jsonio
from qbuild.core.dtypes import torch_dtype


def _port_module(port: str, module: str):
    # Main-lineage ports import `src.*` (the port directory on sys.path), moe-lineage ports import flat (src/ on it);
    # the caller passes the directory each lineage needs (qbuild.backends.neuron.ports.Lineage.module_dir).
    sys.path.insert(0, port)
    return importlib.import_module(module)


def compile_text(req: dict) -> dict:
    """One NxDI compile() with every CTE and TKG bucket -> <out>/model.pt and NxDI's <out>/neuron_config.json.

    As contrib/models/Qwen3.5-35B-A3B/test/integration/run_text_smoke.py @ 4bcdc54 builds it: the NeuronConfig
    (MoENeuronConfig for MoE), the router set to fp32 softmax as attributes, the port's InferenceConfig from the
    flattened text fields, then `App(model_path, config).compile(out)`. The app is subclassed only to return the
    recipe's compiler arguments from get_compiler_args(), which NxDI's ModelWrapper takes in place of its own defaults
    and then appends to: always `--internal-hlo2tensorizer-options='... --verify-hlo=true'`, and the output
    completion notifications where the config enables them (model_wrapper.py L145-165 @ ef2731e).
    """
    cfg = req["config"]
    module = _port_module(req["port"], cfg["module"])
    app_cls = getattr(module, cfg["app_class"])
    config = text_config(module, cfg, req["kwargs"])
    args = cfg["compiler_args"]

    class App(app_cls):
        def get_compiler_args(self):
            return args

    App.__name__ = App.__qualname__ = app_cls.__name__
    app = App(req["model_dir"], config=config)
    app.compile(req["out"])
    _keep_metaneff(Path(req["work_dir"]), Path(req["out"]) / "metaneff")
    return {"neffs": cfg["neffs"]}


def text_config(module, cfg: dict, kwargs: dict):
    """The port's InferenceConfig of a text compile (`cfg`: config.neuron_config's document, `kwargs`:
    config.inference_kwargs), as the ports' scripts build it before they compile, and before their VL benchmark loads
    the compiled model (run_vl_benchmark.py L51-84 @ 4bcdc54): the NeuronConfig (MoENeuronConfig for MoE), the router
    attributes set after construction, then the port's config class over the flattened text fields."""
    from neuronx_distributed_inference.models.config import MoENeuronConfig, NeuronConfig

    nc = (MoENeuronConfig if cfg["neuron_config_class"] == "MoENeuronConfig" else NeuronConfig)(**cfg["neuron_config"])
    for dotted, value in cfg["attributes"].items():
        owner, attr = dotted.rsplit(".", 1)
        setattr(getattr(nc, owner), attr, torch_dtype(value) if attr == "dtype" else value)
    return getattr(module, cfg["config_class"])(neuron_config=nc, **kwargs)


def padding_slot_vision_inputs(config, batch: int, text_prompt_dummy: str) -> list | None:
    """The llava_args of a text-only prompt's context encoding where the port would otherwise zero the prompt's last
    token (`text_prompt_dummy`, ports.Lineage: "always", or "switch" with `use_text_only_cte_inputs` False, the main
    ports' VL compiles), else None (the graph takes empty ones, or the port moves its dummy to a padding slot itself).

    Passed no llava_args, the port's `_get_model_outputs` builds zero embeddings and a mask whose every slot is
    `seq_len - 1` of the unpadded prompt (2B modeling_qwen35.py L7650, L7666-7675 @ 4bcdc54: NxDI pads later, in the
    wrapper); `Qwen35ModelWrapper.pad_inputs` keeps those slots and appends the padding ones after them (L7173-7186),
    and the graph's scatter (`encode_vision_to_input`, index_put_ at L5688) writes a zero row at the prompt's last
    token, so its embedding is lost. These are the inputs the port's VL generate builds for an image prompt without
    its image: rows of zeros and every slot at `neuron_config.seq_len - 1`, two tensors as it passes them for
    sequential positions (modeling_qwen35_vl.py L462-490; the mRoPE positions are appended only for 3-D ones, L495,
    so the text model builds the prefill's own, L7656-7659, L7682-7690). pad_inputs cuts them to the bucket and
    clamps the slots to `bucket - 1` (L7063-7101, L7187-7188, L7210-7213): a padding slot, unless the prompt fills its
    bucket, whose last token is then overwritten whatever the mask (docs/vision.md section 8)."""
    import torch

    if text_prompt_dummy == "never" or (text_prompt_dummy == "switch" and config.use_text_only_cte_inputs):
        return None
    nc = config.neuron_config
    return [torch.zeros((batch, nc.seq_len, config.hidden_size), dtype=nc.torch_dtype),
            torch.full((batch, nc.seq_len, 1), nc.seq_len - 1, dtype=torch.int32)]


def is_prefill(input_ids, position_ids) -> bool:
    """A context-encoding call as the port tells one without prefix caching: more than one token, or a position 0
    (`_qwen36_is_prefill_request`, 2B modeling_qwen35.py L4902-4927 @ 4bcdc54)."""
    return input_ids.shape[-1] > 1 or int(position_ids.min()) == 0


def prefill_text_at_padding_slot(app, text_prompt_dummy: str) -> None:
    """Make `app`'s forward give a text-only context encoding the vision inputs of padding_slot_vision_inputs, where
    its graph takes vision inputs. NxDI's generation adapter calls the model's forward with `llava_args` None
    (get_required_kwargs, hf_adapter.py L329-332 @ ef2731e), and passing them to generate would hand them to every
    decode as well, whose graph takes empty ones; the adapter binds `forward` when it is built (L131), so this runs
    before it is."""
    if padding_slot_vision_inputs(app.config, 1, text_prompt_dummy) is None:
        return
    forward = app.forward

    def forward_with_vision_inputs(*args, **kwargs):
        ids, positions = kwargs.get("input_ids"), kwargs.get("position_ids")
        if not kwargs.get("llava_args") and ids is not None and positions is not None and is_prefill(ids, positions):
            kwargs["llava_args"] = padding_slot_vision_inputs(app.config, ids.shape[0], text_prompt_dummy)
        return forward(*args, **kwargs)

    app.forward = forward_with_vision_inputs


def _keep_metaneff(work_dir: Path, dst: Path) -> None:
    """Copy each bucket's metaneff.pb (<work dir>/<tag>/_tp0_bk<i>/metaneff.pb: NxD model_builder.py @ fbac349)
    before the next compile wipes the work dir: they name the weights the compiled model takes."""
    for src in sorted(work_dir.glob("*/_tp0_bk*/metaneff.pb")):
        target = dst / src.parent.parent.name / f"{src.parent.name}.pb"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, target)


def compile_vision(req: dict) -> dict:
    """torch_neuronx.trace of the port's CPUVisionModel at one bucket, weights inlined, saved with torch.jit.save.

    As contrib/models/Qwen3.5-35B-A3B/test/integration/compile_vision_encoder.py @ 4bcdc54: example inputs
    (hidden (S, hidden), mask (1, 1, S, S), cos and sin (S, head_dim)) in the model dtype. qbuild's converted vision
    weights carry CPUVisionModel's own names (qbuild/model/convert/vision.py), so they load strictly; the patch and position
    embeddings run on the host and stay out.
    """
    import torch
    import torch_neuronx
    from safetensors.torch import load_file

    cfg, v = req["config"], req["vision"]
    module = _port_module(req["port"], req["module"])
    model = module.CPUVisionModel(SimpleNamespace(**v))
    state = {k: t for k, t in load_file(req["weights"]).items() if not k.startswith(("patch_embed.", "pos_embed."))}
    model.load_state_dict(state, strict=True)
    dtype = torch_dtype(req["dtype"])
    model = model.to(dtype).eval()
    s, hidden = cfg["bucket"], v["hidden_size"]
    head_dim = hidden // v["num_heads"]
    example = (torch.zeros((s, hidden), dtype=dtype), torch.zeros((1, 1, s, s), dtype=dtype),
               torch.zeros((s, head_dim), dtype=dtype), torch.zeros((s, head_dim), dtype=dtype))
    traced = torch_neuronx.trace(model, example, compiler_workdir=req["work_dir"],
                                 compiler_args=cfg["compiler_args"].split())
    Path(req["out"]).parent.mkdir(parents=True, exist_ok=True)
    torch.jit.save(traced, req["out"])
    return {"bucket": s}


# How compile_vision_tp hands its request to the factory parallel_model_trace calls once per rank, in processes of
# its own (NxD spawns them: trace/trace.py:345-361 @ fbac349): the environment they inherit, as the port's script does
# (compile_vision_encoder_tp.py:108-123, 164-167 @ 4bcdc54).
TP_VISION_REQUEST = "QBUILD_VISION_TP_REQUEST"


def compile_vision_tp(req: dict) -> dict:
    """NxD's parallel_model_trace of the port's NeuronQwen35VisionModel at one bucket over tp ranks, weights inlined,
    saved with parallel_model_save (one tp_<rank>.pt per rank in <out>/), as
    contrib/models/Qwen3.5-2B/test/integration/compile_vision_encoder_tp.py:149-188 @ 4bcdc54 does: example inputs
    (hidden, mask, (cos, sin)) in the model dtype, the RoPE pair one input, as the port's _TPVisionAdapter calls it
    (modeling_qwen35_vision.py:75-92).

    Only a port whose vision wrapper loads TP buckets can serve the result: the 2B port's module defines
    _TPVisionAdapter for that (L75), the 35B-A3B port's does not (its load_compiled reads vision_encoder_<b>.pt only),
    so the build fails here, naming the port, rather than package a bundle its port cannot load."""
    import os

    import torch
    from neuronx_distributed.trace import parallel_model_save, parallel_model_trace

    cfg, v = req["config"], req["vision"]
    module = _port_module(req["port"], req["module"])
    if not hasattr(module, "_TPVisionAdapter"):
        raise RuntimeError(f"the port's {req['module']} loads no TP-sharded vision encoder (it has no "
                           "_TPVisionAdapter, which NeuronQwen35VisionModelWrapper.load_compiled uses for "
                           "bucket_<N>/tp_*.pt); set vision.tp: 1, or use a port that loads them (Qwen3.5-2B "
                           "@ 4bcdc54)")
    os.environ[TP_VISION_REQUEST] = json.dumps({k: req[k] for k in ("port", "module", "vision", "dtype", "weights")})
    dtype = torch_dtype(req["dtype"])
    s, hidden = cfg["bucket"], v["hidden_size"]
    head_dim = hidden // v["num_heads"]
    example = (torch.zeros((s, hidden), dtype=dtype), torch.zeros((1, 1, s, s), dtype=dtype),
               (torch.zeros((s, head_dim), dtype=dtype), torch.zeros((s, head_dim), dtype=dtype)))
    # NxD pickles the factory into each rank's spawned process, by module and name: this module runs as __main__
    # (`python -m ...`), so the factory is taken from its importable name, which the ranks import.
    from qbuild.backends.neuron.sdk_worker import tp_vision_model as factory

    traced = parallel_model_trace(factory, example, tp_degree=cfg["tp_degree"], compiler_workdir=req["work_dir"],
                                  compiler_args=cfg["compiler_args"].split())
    parallel_model_save(traced, req["out"])
    return {"bucket": s, "tp_degree": cfg["tp_degree"]}


def tp_vision_model():
    """parallel_model_trace's model factory, run once per rank: the port's NeuronQwen35VisionModel in the model dtype,
    the converted vision weights (the port's own names: qbuild/model/convert/vision.py) sliced for this rank by NxD's
    get_sharded_checkpoint and loaded strictly. Returns (model, input_output_alias) (trace/trace.py:212 @ fbac349)."""
    import os

    from neuronx_distributed.parallel_layers.parallel_state import (get_tensor_model_parallel_rank,
                                                                    get_tensor_model_parallel_size)
    from neuronx_distributed.trace.trace import get_sharded_checkpoint
    from safetensors.torch import load_file

    req = json.loads(os.environ[TP_VISION_REQUEST])
    module = _port_module(req["port"], req["module"])
    dtype = torch_dtype(req["dtype"])
    model = module.NeuronQwen35VisionModel(SimpleNamespace(**req["vision"])).to(dtype).eval()
    state = {k: t.to(dtype) for k, t in load_file(req["weights"]).items()
             if not k.startswith(("patch_embed.", "pos_embed."))}
    get_sharded_checkpoint(state, model, get_tensor_model_parallel_rank(), get_tensor_model_parallel_size())
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"vision weights for NeuronQwen35VisionModel: missing {sorted(missing)}, unexpected "
                         f"{sorted(unexpected)}")
    return model, {}


def verify(req: dict) -> dict:
    """Load a bundle as NxDI's compiled directory and generate greedily on every prompt.

    `App(dir).load(dir)` then `HuggingFaceGenerationAdapter(app).generate(...)` as the ports' run_text_smoke.py does.
    Without on-device sampling the first step's logits come from generate's output_scores, the way NxDI's own accuracy
    check reads them (utils/accuracy.py @ 4bcdc54), and are written beside the result. With it the compiled graphs
    return the chosen token and no logits, so generate's scores stay empty (utils/hf_adapter.py L202-230 @ ef2731e:
    outputs.logits is None, the token is outputs.tokens) and only the tokens come back (docs/nxdi.md section 21).
    Where the port's text model would zero a text prompt's last token (a VL bundle of the main ports, any bundle of
    the Qwen3.5-27B port: ports.Lineage.text_prompt_dummy), the prompts are given the image path's padding inputs
    (prefill_text_at_padding_slot), so that verify checks the compiled model on the whole prompt (at batch 1: the
    Qwen3.5-27B port's padding of a short batch zeroes row 0's last token whatever it is given, docs/vision.md
    section 7).
    """
    import torch
    from neuronx_distributed_inference.utils.hf_adapter import HuggingFaceGenerationAdapter
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    module = _port_module(req["port"], req["module"])
    app = getattr(module, req["app_class"])(req["bundle"])
    app.load(req["bundle"])
    on_device = app.neuron_config.on_device_sampling_config is not None
    prefill_text_at_padding_slot(app, req["text_prompt_dummy"])
    adapter = HuggingFaceGenerationAdapter(app)
    n = req["new_tokens"]
    # top_k 1 is what the ports' scripts generate with; it reaches the compiled sampler as its sampling params
    # (hf_adapter.py L161-166), whose argmax ignores them (modules/generation/sampling.py L459-464).
    gc = GenerationConfig(do_sample=False, pad_token_id=req["pad_token_id"], eos_token_id=None,
                          **({"top_k": 1} if on_device else {}))
    greedy, logits = [], {}
    for i, ids in enumerate(req["prompts"]):
        input_ids = torch.tensor([ids], dtype=torch.long)
        out = adapter.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=n,
                               min_new_tokens=n, do_sample=False, return_dict_in_generate=True,
                               output_scores=not on_device, generation_config=gc)
        greedy.append(out.sequences[0, len(ids):].tolist())
        if not on_device:
            logits[f"prompt{i}"] = out.scores[0][0].float().unsqueeze(0).contiguous()
    if logits:
        save_file(logits, req["logits"])
    return {"greedy": greedy, "logits": not on_device}


OPS = {"text": compile_text, "vision": compile_vision, "vision_tp": compile_vision_tp, "verify": verify}


def main(argv: list[str]) -> int:
    op, request, result = argv
    try:
        out = OPS[op](json.loads(Path(request).read_text()))
    except Exception as e:  # the parent reports the last stderr line as one line; the full log goes to the step log
        import traceback

        traceback.print_exc()
        print(f"error: {type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    Path(result).write_text(jsonio.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
