"""Fake of the main-lineage port's src/modeling_qwen35_vl.py (Qwen3.5-2B and Qwen3.5-35B-A3B @ 4bcdc54, the same file):
the VL model the ports' VL scripts load and generate with, which is no NxDI application but composes the text app and
the vision wrapper and runs its own loop (L251-265).

- `Qwen35VLInferenceConfig(text_config, vision_config, image_token_id, video_token_id, vision_start_token_id,
  vision_end_token_id, spatial_merge_size, vision_seq_len_buckets)` keeps them as attributes (L211-248).
- `NeuronQwen35VLForCausalLM(model_path, text_config, vision_config=None, processor=None)` builds
  `text_model = NeuronQwen35ForCausalLM(model_path=model_path, config=text_config)` and, with a vision config,
  `vision_model_wrapper = NeuronQwen35VisionModelWrapper(config=SimpleNamespace(**vision_config.vision_config),
  model_cls=None, vision_seq_len_buckets=...)` (L267-303). `load(compiled, vision_compiled_path)` (L325-355) is the
  benchmark's steps in one; the VL benchmark calls them one by one (run_vl_benchmark.py L119-131).
- `generate(input_ids, attention_mask, pixel_values, image_grid_thw, video_grid_thw, max_new_tokens, temperature,
  top_p, top_k, eos_token_ids)` (L363-603): reset the text model; with an image, the 3-D mRoPE positions of the whole
  prompt and the deltas a decode adds (get_rope_index, L69-208), the wrapper's features for the image, and llava_args =
  [features padded with zeros to (1, seq_len, H), the image tokens' positions padded with seq_len - 1 to
  (1, seq_len, 1) int32, the mRoPE positions padded with zeros to (3, 1, seq_len) int32], seq_len being the text
  config's neuron_config.seq_len (L424-505); context encoding with sequential position_ids and an all-ones attention
  mask (L509-572); then a decode per token at position (length - 1) + the deltas, fed the last token (L581-601),
  stopping after an end-of-sequence token (L577-579, L599-601). A step's token is the output's `tokens` where
  on-device sampling filled it, else the argmax of its logits at temperature 0 (L530-561, L605-619).

Stricter than the port: generate refuses before load, and image features whose rows are not the prompt's image tokens
(the port cuts the features to the tokens and scatters what it has).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from neuronx_distributed_inference._double import record

from src.modeling_qwen35 import NeuronQwen35ForCausalLM
from src.modeling_qwen35_vision import NeuronQwen35VisionModelWrapper

DEFAULT_EOS = {248044, 248046}    # L357-361


def rope_index(input_ids, image_grid_thw, image_token_id: int, vision_start_token_id: int, merge: int):
    """(positions (3, 1, n), delta (1, 1)) of one prompt: text tokens count up on all three axes; an image's merged
    tokens take (t, h, w) of their place in its merged grid, offset by the position where the image starts; the text
    after it resumes past the image's largest position. Only images (no video), one row."""
    ids = input_ids[0].tolist()
    grids = [list(map(int, g)) for g in image_grid_thw.tolist()]
    starts = [i + 1 for i, tok in enumerate(ids[:-1]) if tok == vision_start_token_id and ids[i + 1] == image_token_id]
    columns, at, nxt = [], 0, 0
    for start, (t, h, w) in zip(starts, grids):
        gh, gw = h // merge, w // merge
        columns += [[nxt + k] * 3 for k in range(start - at)]
        nxt += start - at
        columns += [[nxt + a, nxt + b, nxt + c] for a in range(t) for b in range(gh) for c in range(gw)]
        nxt = max(nxt + t, nxt + gh, nxt + gw)
        at = start + t * gh * gw
    columns += [[nxt + k] * 3 for k in range(len(ids) - at)]
    positions = torch.tensor(columns, dtype=torch.long).T.unsqueeze(1)
    return positions, torch.tensor([[int(positions.max()) + 1 - len(ids)]])


class Qwen35VLInferenceConfig:
    def __init__(self, text_config, vision_config, image_token_id=248056, video_token_id=248057,
                 vision_start_token_id=248053, vision_end_token_id=248054, spatial_merge_size=2,
                 vision_seq_len_buckets=None, **kwargs):
        self.text_config, self.vision_config = text_config, vision_config
        self.image_token_id, self.video_token_id = image_token_id, video_token_id
        self.vision_start_token_id, self.vision_end_token_id = vision_start_token_id, vision_end_token_id
        self.spatial_merge_size = spatial_merge_size
        self.vision_seq_len_buckets = vision_seq_len_buckets or [1024, 4096, 16384]


class NeuronQwen35VLForCausalLM:
    def __init__(self, model_path, text_config, vision_config=None, processor=None):
        self.model_path, self.text_config, self.vl_config = model_path, text_config, vision_config
        self.text_model = NeuronQwen35ForCausalLM(model_path=model_path, config=text_config)
        self.vision_model_wrapper = None
        self._vl_config = None
        if vision_config is not None:
            self.vision_model_wrapper = NeuronQwen35VisionModelWrapper(
                config=SimpleNamespace(**vision_config.vision_config), model_cls=None,
                vision_seq_len_buckets=vision_config.vision_seq_len_buckets)
            self._vl_config = vision_config
        self.rope_deltas = None
        record("vl_init", model_path=str(model_path), vision=vision_config is not None,
               text_config_cls=type(text_config).__name__,
               use_text_only_cte_inputs=getattr(text_config, "use_text_only_cte_inputs", None))

    def generate(self, input_ids, attention_mask=None, pixel_values=None, image_grid_thw=None, video_grid_thw=None,
                 max_new_tokens=32, temperature=0.0, top_p=1.0, top_k=0, eos_token_ids=None, **kwargs):
        eos = DEFAULT_EOS if eos_token_ids is None else eos_token_ids
        self.text_model.reset()
        has_vision = pixel_values is not None and pixel_values.numel() > 0
        n = input_ids.shape[1]
        llava_args = []
        self.rope_deltas = None
        if has_vision and self._vl_config is not None:
            cfg = self._vl_config
            positions, self.rope_deltas = rope_index(input_ids, image_grid_thw, cfg.image_token_id,
                                                     cfg.vision_start_token_id, cfg.spatial_merge_size)
            features = self.vision_model_wrapper(pixel_values, image_grid_thw)
            where = ((input_ids == cfg.image_token_id) | (input_ids == cfg.video_token_id))[0].nonzero().flatten()
            if features.shape[0] != where.shape[0]:
                raise ValueError(f"{features.shape[0]} image features for {where.shape[0]} image tokens")
            limit = self.text_config.neuron_config.seq_len
            emb = torch.zeros((1, limit, features.shape[-1]), dtype=features.dtype)
            emb[0, :where.shape[0]] = features
            mask = torch.full((1, limit, 1), limit - 1, dtype=torch.int32)
            mask[0, :where.shape[0], 0] = where.to(torch.int32)
            mrope = torch.zeros((3, 1, limit), dtype=torch.int32)
            mrope[:, :, :n] = positions.to(torch.int32)
            llava_args = [emb, mask, mrope]
        record("vl_generate", prompt_tokens=n, image=has_vision, max_new_tokens=max_new_tokens,
               temperature=temperature, eos=sorted(eos))
        out = self.text_model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids) if attention_mask is None
                              else attention_mask, position_ids=torch.arange(n).unsqueeze(0),
                              output_attentions=False, output_hidden_states=False, return_dict=False,
                              llava_args=llava_args)
        generated = torch.cat([input_ids, _next_token(out).unsqueeze(-1).to(input_ids.dtype)], dim=-1)
        if int(generated[0, -1]) in eos:
            return generated
        for _ in range(max_new_tokens - 1):
            position = torch.tensor([[generated.shape[1] - 1]])
            if self.rope_deltas is not None:
                position = position + self.rope_deltas
            out = self.text_model(input_ids=generated[:, -1:], position_ids=position, output_attentions=False,
                                  output_hidden_states=False, return_dict=False)
            generated = torch.cat([generated, _next_token(out).unsqueeze(-1).to(input_ids.dtype)], dim=-1)
            if int(generated[0, -1]) in eos:
                break
        return generated


def _next_token(output):
    """L530-561 at temperature 0: the output's tokens where on-device sampling filled them ((B,) int32), else the
    argmax of the last position's logits ((B, T, V): NxDI puts the logits in `tokens` too)."""
    head = output.tokens
    return head if head.ndim == 1 else head[:, -1, :].argmax(dim=-1)
