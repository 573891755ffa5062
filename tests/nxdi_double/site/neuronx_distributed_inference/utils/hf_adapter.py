"""Contract double of NxDI utils/hf_adapter.py (@ ef2731e): HuggingFaceGenerationAdapter, and load_pretrained_config
(the hook vllm-neuron builds a port's InferenceConfig with: docs/vllm.md).

Called as NxDI's own accuracy check calls it (docs/nxdi.md section 13, utils/accuracy.py L631-655):
`generate(input_ids=..., attention_mask=..., max_new_tokens=n, min_new_tokens=n, do_sample=False,
return_dict_in_generate=True, output_scores=True, generation_config=gc)` -> `.sequences` [B, prompt + n] and
`.scores`, a tuple of n [B, V] tensors. Each step is a call of the model's `forward`, which the adapter binds when it
is built (L131: "Neuron Forward is needed by any models with additional input args"), with the whole prompt first,
then the last token at position (prompt length + steps) - 1 (prepare_inputs_for_generation L259-334: position_ids
from the attention mask's cumulative sum, `llava_args` None from get_required_kwargs, L329-332). The double cannot run
the model, so its tokens are the double forward's fixed function of the prompt (next = (sum of the sequence so far) %
V, less what the port's image inputs overwrite) and its scores a one-hot of that token: tests can check plumbing and
thresholds, never accuracy. A model compiled with on-device sampling returns each step's token and no logits
(models/model_base.py _construct_output L3832-3862 @ ef2731e: `logits=None if self.on_device_sampling`, L3845), so
_sample appends no scores (L202-212: only `if outputs.logits is not None`) and takes `outputs.tokens` (L214-230):
`.scores` is then an empty tuple, unless output_logits also returns the logits (model_base.py L3799-3802). It refuses what the compiled model could not do: generating before load(), a prompt longer
than the largest context-encoding bucket, or a total length beyond the largest token-generation bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neuronx_distributed_inference._double import record

def load_pretrained_config(model_path_or_name=None, hf_config=None):
    """L36-80: a load_config hook for InferenceConfig that reads the HF config with transformers' AutoConfig and sets
    its fields on the config: `dtype` (or `torch_dtype`) goes to the neuron_config unless that overrides it, and a
    nested PretrainedConfig (text_config) becomes a SimpleNamespace, left nested."""
    from types import SimpleNamespace

    from transformers import AutoConfig, PretrainedConfig

    from neuronx_distributed_inference.models.config import to_torch_dtype

    def load_config(self):
        if (model_path_or_name is None) == (hf_config is None):
            raise ValueError('Please provide only one of "model_path_or_name" or "hf_config"')
        config = AutoConfig.from_pretrained(model_path_or_name) if model_path_or_name is not None else hf_config
        config_dict = config.to_dict()
        if config.transformers_version is not None:
            config_dict["transformers_version"] = config.transformers_version
        hf_dtype = config_dict.get("dtype", config_dict.get("torch_dtype", None))
        if hf_dtype is not None:
            if self.neuron_config is not None and not self.neuron_config.overrides_torch_dtype:
                self.neuron_config.torch_dtype = to_torch_dtype(hf_dtype) if isinstance(hf_dtype, str) else hf_dtype
            config_dict.pop("dtype", None)
            config_dict.pop("torch_dtype", None)
        for k, v in config_dict.items():
            if isinstance(getattr(config, k), PretrainedConfig):
                config_dict[k] = SimpleNamespace(**v)
        self.__dict__.update(config_dict)
        if hasattr(config, "attribute_map"):
            self.attribute_map = config.attribute_map
        record("load_pretrained_config", path=str(model_path_or_name), keys=sorted(config_dict))

    return load_config


_GENERATE_KWARGS = {"max_new_tokens", "min_new_tokens", "do_sample", "return_dict_in_generate", "output_scores"}


@dataclass
class GenerateOutput:
    sequences: torch.Tensor
    scores: tuple[torch.Tensor, ...] | None


class HuggingFaceGenerationAdapter:
    def __init__(self, model, input_start_offsets=None, capture_draft_logits=False):
        self.neuron_model = model
        self.input_start_offsets = input_start_offsets
        self.forward = model.forward
        record("HuggingFaceGenerationAdapter", model=type(model).__name__)

    def generate(self, input_ids=None, attention_mask=None, generation_config=None, **kwargs):
        unknown = sorted(set(kwargs) - _GENERATE_KWARGS)
        if unknown:
            raise TypeError(f"generate: the double does not model {unknown}")
        model = self.neuron_model
        if not getattr(model, "is_loaded", False):
            raise RuntimeError("generate: the model was not loaded (call load(compiled_model_path) first)")
        if input_ids is None or input_ids.dim() != 2:
            raise ValueError("generate: input_ids must be a [batch, tokens] tensor")
        model.reset()
        nc = model.neuron_config
        n = kwargs.get("max_new_tokens") or getattr(generation_config, "max_new_tokens", None)
        if not n:
            raise ValueError("generate: the double needs max_new_tokens (it does not model max_length-driven stops)")
        largest = {s.tag: max(s.buckets) for s in model.submodels}
        if input_ids.shape[1] > largest["context_encoding_model"]:
            raise ValueError(f"generate: a {input_ids.shape[1]}-token prompt exceeds the largest context-encoding "
                             f"bucket {largest['context_encoding_model']}")
        total = input_ids.shape[1] + n
        if total > min(nc.max_length, largest["token_generation_model"]):
            raise ValueError(f"generate: {input_ids.shape[1]} + {n} tokens exceed the largest token-generation bucket "
                             f"{largest['token_generation_model']} (max_length {nc.max_length})")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError("generate: attention_mask must have input_ids' shape")
        sampled = nc.on_device_sampling_config is not None
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        sequences, scores = input_ids.clone(), []
        for step in range(n):
            positions = mask.long().cumsum(-1) - 1
            if step == 0:
                out = self.forward(input_ids=sequences, attention_mask=mask, position_ids=positions, llava_args=None)
            else:
                out = self.forward(input_ids=sequences[:, -1:], attention_mask=mask,
                                   position_ids=positions.amax(1, keepdim=True) + 1, llava_args=None)
                mask = torch.cat([mask.new_ones((mask.shape[0], 1)), mask], dim=-1)   # L389-404
            if out.logits is not None:                      # L202-212
                scores.append(out.logits[:, -1, :].clone())
            # L214-230: the token the device chose, else the greedy pick of the logits (do_sample False).
            nxt = out.tokens.reshape(-1) if sampled else out.logits[:, -1, :].argmax(-1)
            sequences = torch.cat([sequences, nxt.to(sequences.dtype).unsqueeze(1)], dim=1)
        record("generate", prompt_tokens=list(input_ids.shape), new_tokens=n, on_device_sampling=sampled,
               kwargs={k: v for k, v in sorted(kwargs.items())},
               generation_config={k: getattr(generation_config, k, None)
                                  for k in ("do_sample", "pad_token_id", "eos_token_id", "top_k")})
        if not kwargs.get("return_dict_in_generate"):
            return sequences
        return GenerateOutput(sequences, tuple(scores) if kwargs.get("output_scores") else None)
