"""What each rank's `tp{r}_sharded_checkpoint.safetensors` must HOLD, derived from the HF checkpoint a bundle was built
from, for the double's load() to compare value by value.

This is the contract double's own derivation, written from the facts in docs/nxd-layout.md and docs/nxdi.md (sections
named per rule below), never from qbuild's converters: it exists to catch a converter that writes the right names,
shapes and dtypes in the wrong order, on the wrong rank or with a missing transform. The real NxD gets these values
by running the port's converter and its own preshard hooks and slicing (docs/nxdi.md section 4); loading pre-sharded
files, nothing on the device has the HF checkpoint to compare with, so a bundle whose slices are swapped loads and
computes garbage, and the double's verify (thresholds of 0) would not notice.

Where the facts stop, the rule says so and checks what it can (`Unstated`; listed in docs/nxdi.md section 9).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

# FP8 (docs/nxd-layout.md section 5): per-channel symmetric e4m3, scale = max|row| / 240 floored at 1e-5.
FP8_MAX = 240.0
FP8_SCALE_FLOOR = 1e-5


@dataclass(frozen=True)
class Expected:
    """The value one rank must hold under one name: `tensor` exactly (after the cast to the shard's dtype), or, for
    FP8 weights, within `fp8_scale`'s quantization step (the rounding order of the quantizer is not in the facts)."""

    tensor: torch.Tensor
    source: str                      # the HF tensor(s) it comes from, for the error line
    fp8_scale: torch.Tensor | None = None


class Unstated(Exception):
    """The facts do not say what this rank holds here; the caller checks what it can across ranks: that each of
    `heads` (n, d, H), the source heads the tensor is made of, is held whole by some rank after the first
    `prefix.shape[0]` rows, which are stated and must equal `prefix`."""

    def __init__(self, why: str, heads: torch.Tensor | None = None, prefix: torch.Tensor | None = None):
        super().__init__(why)
        self.heads, self.prefix = heads, prefix


class HFCheckpoint:
    """The HF checkpoint's text tensors under their prefix-free names (docs/nxd-layout.md section 0) and its text
    config (text_config flattened)."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = Path(path)
        doc = json.loads((self.path / "config.json").read_text())
        text = doc.get("text_config") or doc
        self.config = dict(text)
        self.config.setdefault("tie_word_embeddings", doc.get("tie_word_embeddings", False))
        self.tensors: dict[str, torch.Tensor] = {}
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.path}: no *.safetensors in the HF checkpoint")
        for file in files:
            with safe_open(file, "pt") as f:
                for key in f.keys():
                    name = _text_name(key)
                    if name is not None:
                        self.tensors[name] = f.get_tensor(key)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise KeyError(f"{self.path}: the HF checkpoint has no {name}")
        return self.tensors[name]


def _text_name(key: str) -> str | None:
    """Section 0: `model.language_model.` (VL) or `model.` (text-only) stripped, lm_head kept, vision and mtp
    dropped."""
    if key.startswith(("model.visual.", "mtp.")):
        return None
    for prefix in ("model.language_model.", "model."):
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


@dataclass(frozen=True)
class Layout:
    """What the compiled model's config says about the split (neuron_config.json), and the port's lineage."""

    lineage: str           # "main" | "main-replicated" | "moe" (docs/nxdi.md section 1)
    tp: int
    moe_tp: int
    moe_ep: int
    fused_qkv: bool
    dtype: torch.dtype
    quantized: bool
    not_converted: tuple[str, ...]
    pad_token_id: int | None   # the compiled config's (qbuild passes eos where the HF config has none)

    @classmethod
    def of(cls, lineage: str, config) -> "Layout":
        nc = config.neuron_config
        return cls(lineage, nc.tp_degree, getattr(nc, "moe_tp_degree", None) or nc.tp_degree,
                   getattr(nc, "moe_ep_degree", None) or 1, bool(nc.fused_qkv), nc.torch_dtype, bool(nc.quantized),
                   tuple(nc.modules_to_not_convert or ()), getattr(config, "pad_token_id", None))


def _plus_one(w: torch.Tensor) -> torch.Tensor:
    """Section 1: HF's zero-centred RMSNorm weight w stored as w.float() + 1.0."""
    return w.float() + 1.0


# --- Gated GQA (docs/nxd-layout.md section 2; docs/nxdi.md section 4) ----------------------------------------------

def _gqa_counts(heads: int, kv: int, tp: int) -> tuple[bool, int, int]:
    """(REPLICATE_TO_TP_DEGREE?, padded q heads, kv heads per the whole tp group)."""
    replicate = tp % kv == 0
    padded = heads + (-heads) % tp
    if heads == kv:
        kv_total = padded
    elif kv < tp or kv % tp:
        kv_total = tp if replicate else padded
    else:
        kv_total = kv
    return replicate, padded, kv_total


def _pad_heads(t: torch.Tensor, dim: int, heads: int, kv: int, tp: int) -> torch.Tensor:
    """q rows (dim 0) / o_proj columns (dim 1) with NxD's zero heads: REPLICATE pads after each group of heads/kv
    heads (maybe_pad_interleaved), CONVERT_TO_MHA at the tail (maybe_pad_tail)."""
    replicate, padded, _ = _gqa_counts(heads, kv, tp)
    extra = padded - heads
    if not extra:
        return t
    groups = kv if replicate else 1
    d = t.shape[dim] // heads
    runs = t.movedim(dim, 0).reshape(groups, (heads // groups) * d, *t.movedim(dim, 0).shape[1:])
    zeros = runs.new_zeros(groups, (extra // groups) * d, *runs.shape[2:])
    return torch.cat([runs, zeros], dim=1).reshape(padded * d, *runs.shape[2:]).movedim(0, dim)


def _kv_rank(t: torch.Tensor, heads: int, kv: int, tp: int, r: int) -> torch.Tensor:
    """Section 4: REPLICATE_TO_TP_DEGREE repeat_interleaves kv heads up to tp, so rank r holds source head
    r*kv//tp; with kv a multiple of tp the heads split contiguously."""
    replicate, _, kv_total = _gqa_counts(heads, kv, tp)
    if kv_total == kv:
        return t.chunk(tp, 0)[r]
    if not replicate or heads == kv:
        # CONVERT_TO_MHA, or an MHA model whose kv heads grow with the padded q heads: how NxD fills the extra kv heads
        # is not recorded (gqa.py is cited only for the REPLICATE case and for q's tail padding).
        raise Unstated("kv heads under CONVERT_TO_MHA / padded MHA", t.reshape(kv, t.shape[0] // kv, -1))
    d = t.shape[0] // kv
    return t.reshape(kv, d, -1)[r * kv // tp]


def _q_gate(hf: HFCheckpoint, layer: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Section 2: q_proj (nH*2D, H) interleaved per head [q_h | gate_h]: query = [:, :D], gate = [:, D:]."""
    c = hf.config
    w = hf.get(f"{layer}.self_attn.q_proj.weight")
    per_head = w.reshape(c["num_attention_heads"], 2 * c["head_dim"], -1)
    return (per_head[:, :c["head_dim"]].reshape(-1, w.shape[1]), per_head[:, c["head_dim"]:].reshape(-1, w.shape[1]))


def _attention(hf: HFCheckpoint, lay: Layout, layer: str, r: int) -> dict:
    c = hf.config
    heads, kv, tp = c["num_attention_heads"], c["num_key_value_heads"], lay.tp
    src = f"{layer}.self_attn"
    q, gate = _q_gate(hf, layer)
    q_r = _pad_heads(q, 0, heads, kv, tp).chunk(tp, 0)[r]
    out = {f"{src}.output_gate_proj.weight": (gate.chunk(tp, 0)[r], f"{src}.q_proj.weight (gate half)"),
           f"{src}.o_proj.o_proj.weight": (_pad_heads(hf.get(f"{src}.o_proj.weight"), 1, heads, kv, tp)
                                           .chunk(tp, 1)[r], f"{src}.o_proj.weight"),
           f"{src}.q_layernorm.weight": (_plus_one(hf.get(f"{src}.q_norm.weight")), f"{src}.q_norm.weight (+1)"),
           f"{src}.k_layernorm.weight": (_plus_one(hf.get(f"{src}.k_norm.weight")), f"{src}.k_norm.weight (+1)")}
    try:
        k_r = _kv_rank(hf.get(f"{src}.k_proj.weight"), heads, kv, tp, r)
        v_r = _kv_rank(hf.get(f"{src}.v_proj.weight"), heads, kv, tp, r)
    except Unstated as e:
        k_r = v_r = e
    if lay.fused_qkv:
        # Section 2 / docs/nxdi.md section 4: each rank's Wqkv is [Q_r | K_r | V_r] of the padded lengths.
        fused = Unstated(str(k_r), torch.cat([k_r.heads, v_r.heads]), q_r) if isinstance(k_r, Unstated) else \
            torch.cat([q_r, k_r, v_r])
        out[f"{src}.qkv_proj.Wqkv.weight"] = (fused, f"{src}.q_proj (query half) / k_proj / v_proj")
    else:
        out[f"{src}.qkv_proj.q_proj.weight"] = (q_r, f"{src}.q_proj.weight (query half)")
        out[f"{src}.qkv_proj.k_proj.weight"] = (k_r, f"{src}.k_proj.weight")
        out[f"{src}.qkv_proj.v_proj.weight"] = (v_r, f"{src}.v_proj.weight")
    return out


# --- DeltaNet (docs/nxd-layout.md section 3) ------------------------------------------------------------------------

def _deltanet_hf(hf: HFCheckpoint, layer: str) -> dict[str, torch.Tensor]:
    """The HF DeltaNet projections under the Qwen3.5 names: Qwen3-Next's grouped in_proj_qkvz / in_proj_ba
    de-interleaved per key head (section 3, "Qwen3-Next grouped projections")."""
    c = hf.config
    p = f"{layer}.linear_attn"
    if f"{p}.in_proj_qkvz.weight" not in hf.tensors:
        return {n: hf.get(f"{p}.{n}.weight") for n in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b")}
    hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    ratio = hv // hk
    qkvz = hf.get(f"{p}.in_proj_qkvz.weight")
    h = qkvz.shape[1]
    groups = qkvz.reshape(hk, 2 * dk + 2 * dv * ratio, h)
    q, k, v, z = groups.split([dk, dk, dv * ratio, dv * ratio], dim=1)
    ba = hf.get(f"{p}.in_proj_ba.weight").reshape(hk, 2 * ratio, h)
    b, a = ba.split([ratio, ratio], dim=1)
    return {"in_proj_qkv": torch.cat([q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)]),
            "in_proj_z": z.reshape(-1, h), "in_proj_b": b.reshape(-1, h), "in_proj_a": a.reshape(-1, h)}


def _qkv_channels_rank(t: torch.Tensor, key_dim: int, tp: int, r: int) -> torch.Tensor:
    """Section 3, main lineage: rank r holds [Q_r | K_r | V_r] of the channel dim (dim 0)."""
    q, k, v = t[:key_dim], t[key_dim:2 * key_dim], t[2 * key_dim:]
    return torch.cat([q.chunk(tp, 0)[r], k.chunk(tp, 0)[r], v.chunk(tp, 0)[r]])


def _deltanet(hf: HFCheckpoint, lay: Layout, layer: str, r: int) -> dict:
    c = hf.config
    p = f"{layer}.linear_attn"
    proj = _deltanet_hf(hf, layer)
    conv, a_log, dt_bias = hf.get(f"{p}.conv1d.weight"), hf.get(f"{p}.A_log"), hf.get(f"{p}.dt_bias")
    out_proj, norm = hf.get(f"{p}.out_proj.weight"), hf.get(f"{p}.norm.weight")
    if lay.lineage != "main":
        # main-replicated / moe: whole on every rank under the HF names, (conv_dim, 1, K) and (Hv,) (section 3).
        out = {f"{p}.{n}.weight": (t, f"{p}.{n}") for n, t in proj.items()}
        out.update({f"{p}.conv1d.weight": (conv, f"{p}.conv1d.weight"), f"{p}.A_log": (a_log, f"{p}.A_log"),
                    f"{p}.dt_bias": (dt_bias, f"{p}.dt_bias"), f"{p}.out_proj.weight": (out_proj, f"{p}.out_proj"),
                    f"{p}.norm.weight": (norm, f"{p}.norm.weight")})
        return out
    tp = lay.tp
    key_dim = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    return {
        f"{p}.in_proj_qkv.weight": (_qkv_channels_rank(proj["in_proj_qkv"], key_dim, tp, r),
                                    f"{p}.in_proj_qkv (per-rank [Q_r|K_r|V_r])"),
        f"{p}.conv1d_weight.weight": (_qkv_channels_rank(conv[:, 0, :], key_dim, tp, r),
                                      f"{p}.conv1d.weight (per-rank [Q_r|K_r|V_r], dim 1 dropped)"),
        f"{p}.in_proj_z.weight": (proj["in_proj_z"].chunk(tp, 0)[r], f"{p}.in_proj_z"),
        f"{p}.in_proj_a.weight": (proj["in_proj_a"].chunk(tp, 0)[r], f"{p}.in_proj_a"),
        f"{p}.in_proj_b.weight": (proj["in_proj_b"].chunk(tp, 0)[r], f"{p}.in_proj_b"),
        f"{p}.A_log_weight.weight": (a_log.reshape(-1, 1).chunk(tp, 0)[r], f"{p}.A_log (as (Hv, 1))"),
        f"{p}.dt_bias_weight.weight": (dt_bias.reshape(-1, 1).chunk(tp, 0)[r], f"{p}.dt_bias (as (Hv, 1))"),
        f"{p}.out_proj.weight": (out_proj.chunk(tp, 1)[r], f"{p}.out_proj"),
        # The gated norm is a standard norm already: no +1 (section 1).
        f"{p}.norm.weight": (norm, f"{p}.norm.weight"),
    }


# --- MLPs (docs/nxd-layout.md section 4; docs/nxdi.md section 4) ---------------------------------------------------

def _experts(hf: HFCheckpoint, layer: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate (E, I, H), up (E, I, H), down (E, H, I)) from either HF storage form (section 4)."""
    p = f"{layer}.mlp.experts"
    if f"{p}.gate_up_proj" in hf.tensors:
        gate_up = hf.get(f"{p}.gate_up_proj")
        gate, up = gate_up.chunk(2, dim=1)
        return gate, up, hf.get(f"{p}.down_proj")
    e = hf.config["num_experts"]
    stack = [torch.stack([hf.get(f"{p}.{i}.{n}.weight") for i in range(e)]) for n in ("gate_proj", "up_proj",
                                                                                       "down_proj")]
    return stack[0], stack[1], stack[2]


def _moe(hf: HFCheckpoint, lay: Layout, layer: str, r: int) -> dict:
    """Router replicated; experts (E, H, 2I) = [gate^T | up^T] and (E, I, H), each of gate and up sliced on its own over
    moe_tp then concatenated, dim 0 sliced by expert-parallel rank; the shared expert over the FULL tp group."""
    gate, up, down = _experts(hf, layer)
    j, ep_rank = r % lay.moe_tp, (r // lay.moe_tp) % lay.moe_ep
    local = gate.shape[0] // lay.moe_ep
    experts = slice(ep_rank * local, (ep_rank + 1) * local)
    gate_up = torch.cat([gate.transpose(1, 2).chunk(lay.moe_tp, 2)[j], up.transpose(1, 2).chunk(lay.moe_tp, 2)[j]],
                        dim=2)[experts]
    down_r = down.transpose(1, 2).chunk(lay.moe_tp, 1)[j][experts]
    m = f"{layer}.mlp"
    if lay.lineage == "moe":
        names = (f"{m}.router.linear_router.weight", f"{m}.expert_mlps.mlp_op",
                 f"{m}.shared_experts.shared_experts.{{}}_proj.weight", f"{m}.shared_experts.sigmoid_gate.weight")
    else:
        names = (f"{m}.moe.router.linear_router.weight", f"{m}.moe.expert_mlps.mlp_op", f"{m}.shared_{{}}_proj.weight",
                 f"{m}.shared_expert_gate.weight")
    router, mlp_op, shared, shared_gate = names
    tp = lay.tp
    return {router: (hf.get(f"{m}.gate.weight"), f"{m}.gate.weight"),
            f"{mlp_op}.gate_up_proj.weight": (gate_up, f"{m}.experts gate/up (transposed, rank {j} of each)"),
            f"{mlp_op}.down_proj.weight": (down_r, f"{m}.experts down (transposed)"),
            shared.format("gate"): (hf.get(f"{m}.shared_expert.gate_proj.weight").chunk(tp, 0)[r % tp],
                                    f"{m}.shared_expert.gate_proj.weight"),
            shared.format("up"): (hf.get(f"{m}.shared_expert.up_proj.weight").chunk(tp, 0)[r % tp],
                                  f"{m}.shared_expert.up_proj.weight"),
            shared.format("down"): (hf.get(f"{m}.shared_expert.down_proj.weight").chunk(tp, 1)[r % tp],
                                    f"{m}.shared_expert.down_proj.weight"),
            shared_gate: (hf.get(f"{m}.shared_expert_gate.weight"), f"{m}.shared_expert_gate.weight")}


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Section 5: per output channel, scale = max|row| / 240 floored at 1e-5, (out, 1) float32."""
    scale = (w.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(FP8_SCALE_FLOOR)
    return w.float(), scale


def _dense_mlp(hf: HFCheckpoint, lay: Layout, layer: str, r: int) -> dict:
    """Column-parallel gate / up (dim 0), row-parallel down (dim 1). FP8 (NxD's quantized twin, unless a
    modules_to_not_convert entry is a substring of the module path: docs/nxdi.md section 16): the per-channel scale
    of a column-parallel layer splits with its rows, of a row-parallel layer stays whole (section 4)."""
    m = f"{layer}.mlp"
    tp = lay.tp
    out = {}
    for name, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
        w = hf.get(f"{m}.{name}.weight")
        module = f"{m}.{name}"
        if lay.quantized and not any(skip in module for skip in lay.not_converted):
            full, scale = _fp8(w)
            scale_r = scale.chunk(tp, 0)[r] if dim == 0 else scale
            out[f"{module}.weight"] = (full.chunk(tp, dim)[r], f"{module}.weight (fp8)", scale_r)
            out[f"{module}.scale"] = (scale_r, f"{module}.weight (max|row| / 240)")
        else:
            out[f"{module}.weight"] = (w.chunk(tp, dim)[r], f"{module}.weight")
    return out


# --- The whole rank -------------------------------------------------------------------------------------------------

def expected_rank(hf: HFCheckpoint, lay: Layout, r: int) -> dict[str, Expected | Unstated]:
    """{shard key: what rank r must hold} for every float tensor of the text model (the int32 rank tensors are
    checked by the compiled model's own Weight values)."""
    c = hf.config
    tp = lay.tp
    t = r % tp    # non-expert parallel layers split over the tp group; rank r holds slice r % tp (section 14)
    embed = hf.get("embed_tokens.weight")
    lm_head = hf.tensors.get("lm_head.weight")
    if lm_head is None and c.get("tie_word_embeddings"):
        lm_head = embed   # section 0: a tied checkpoint's lm_head is a copy of embed_tokens
    raw: dict = {"embed_tokens.weight": (embed.chunk(tp, 1)[t], "embed_tokens.weight (split on hidden)"),
                 "lm_head.weight": (lm_head.chunk(tp, 0)[t], "lm_head.weight"),
                 "norm.weight": (_plus_one(hf.get("norm.weight")), "norm.weight (+1)")}
    if lay.lineage == "moe":
        raw["embed_tokens.weight"] = _embed_moe(embed, c.get("pad_token_id"), lay.pad_token_id, tp, t)
    for i, kind in enumerate(c["layer_types"]):
        layer = f"layers.{i}"
        raw[f"{layer}.input_layernorm.weight"] = (_plus_one(hf.get(f"{layer}.input_layernorm.weight")),
                                                  f"{layer}.input_layernorm.weight (+1)")
        raw[f"{layer}.post_attention_layernorm.weight"] = (
            _plus_one(hf.get(f"{layer}.post_attention_layernorm.weight")),
            f"{layer}.post_attention_layernorm.weight (+1)")
        raw.update(_attention(hf, lay, layer, t) if kind == "full_attention" else _deltanet(hf, lay, layer, t))
        if f"{layer}.mlp.gate.weight" in hf.tensors:
            raw.update(_moe(hf, lay, layer, r))
        else:
            raw.update(_dense_mlp(hf, lay, layer, t))
    out: dict[str, Expected | Unstated] = {}
    for name, value in raw.items():
        tensor, source, *scale = value
        if isinstance(tensor, Unstated):
            out[name] = tensor
        else:
            out[name] = Expected(tensor, source, scale[0] if scale else None)
    return out


def zero_weights(weights: dict) -> dict[str, Expected]:
    """The weights the compiled model takes that hold zeros on every rank, whatever the checkpoint: the DeltaNet
    checkpoint banks of the hybrid APC manager (docs/long-context.md section 5)."""
    return {name: Expected(torch.zeros(w.shape), f"{name} (zeros: the port writes the bank zeroed)")
            for name, w in weights.items() if w.value is not None and w.value["kind"] == "zeros"}


class _RowUnstated(Unstated):
    """Everything is stated but one row (`row`), which may hold either the expected row or zeros."""

    def __init__(self, expected: Expected, row: int):
        super().__init__(f"row {row}")
        self.expected, self.row = expected, row


def _embed_moe(embed: torch.Tensor, hf_pad: int | None, compiled_pad: int | None, tp: int, t: int):
    """Section 3 (last paragraph): the Coder-Next converter zeroes embed_tokens[pad_token_id] before the split. Which
    pad_token_id it reads where the HF config names none is not recorded: the compiled config then carries qbuild's
    stand-in (eos), and its row may hold either zeros or the HF row."""
    full = embed.clone()
    if hf_pad is not None:
        full[hf_pad] = 0
        return full.chunk(tp, 1)[t], "embed_tokens.weight (pad row zeroed, split on hidden)"
    expected = Expected(full.chunk(tp, 1)[t], "embed_tokens.weight (split on hidden)")
    return (_RowUnstated(expected, compiled_pad) if compiled_pad is not None else expected.tensor), expected.source


def mismatch(got: torch.Tensor, want: Expected) -> str | None:
    """None where `got` holds `want`, else what differs (one line)."""
    if want.fp8_scale is not None:
        # e4m3 keeps 3 mantissa bits: a value off by more than its rounding step (relative 2^-4, plus the subnormal
        # step of the scaled range) is not this weight quantized.
        deq = got.float() * want.fp8_scale
        bad = (deq - want.tensor).abs() > want.tensor.abs() * 0.0625 + want.fp8_scale * 2.0 ** -6 + 1e-12
    else:
        expected = want.tensor.to(got.dtype)
        if got.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            bad = got.view(torch.uint8) != expected.view(torch.uint8)
        else:
            bad = ~((got == expected) | (torch.isnan(got) & torch.isnan(expected)))
    if not bool(bad.any()):
        return None
    index = tuple(int(i) for i in bad.nonzero()[0])
    first_want = want.tensor.float()[index].item()
    return (f"{int(bad.sum())} of {bad.numel()} values differ from {want.source} as NxD lays it out (first at "
            f"{list(index)}: {got.float()[index].item():.6g}, expected {first_want:.6g})")


def check_rank(file: str, r: int, tensors: dict[str, torch.Tensor], expected: dict) -> None:
    """Raise one line naming `file` and the first tensor whose values are not what rank r must hold."""
    for name in sorted(tensors):
        got = tensors[name]
        if not got.is_floating_point():
            continue
        want = expected.get(name)
        if want is None:
            raise RuntimeError(f"{file}: {name}: the contract double derives no expected value for it from the HF "
                               "checkpoint (extend neuronx_distributed_inference/_values.py from the facts)")
        if isinstance(want, _RowUnstated):
            other = want.expected.tensor.clone()
            other[want.row] = 0
            if mismatch(got, want.expected) and mismatch(got, Expected(other, want.expected.source)):
                raise RuntimeError(f"{file}: {name}: {mismatch(got, want.expected)}")
            continue
        if isinstance(want, Unstated):
            if want.prefix is not None:
                why = mismatch(got[:want.prefix.shape[0]], Expected(want.prefix, f"{name} (its query rows)"))
                if why:
                    raise RuntimeError(f"{file}: {name}: {why}")
            continue   # the rest is checked across ranks by check_unstated
        why = mismatch(got, want)
        if why:
            raise RuntimeError(f"{file}: {name}: {why}")


def check_unstated(files: list[str], ranks: list[dict[str, torch.Tensor]], expected: list[dict]) -> list[str]:
    """What can be checked of the tensors whose per-rank value the facts do not state: every source head is held
    whole by some rank (a lost, truncated or transposed head shows). Returns their names (load records them)."""
    names = sorted({n for exp in expected for n, w in exp.items()
                    if isinstance(w, Unstated) and not isinstance(w, _RowUnstated)})
    for name in names:
        want = next(exp[name] for exp in expected if isinstance(exp.get(name), Unstated))
        d = want.heads.shape[1]
        skip = 0 if want.prefix is None else want.prefix.shape[0]
        held = torch.cat([t[name][skip:].reshape(-1, d, t[name].shape[-1]) for t in ranks])
        for h, head in enumerate(want.heads):
            head = head.to(held.dtype)
            if not any(torch.equal(block, head) for block in held):
                raise RuntimeError(f"{files[0]}..{files[-1]}: {name}: source head {h} is held whole by no rank "
                                   f"({want}; its per-rank layout is not in the facts)")
    return names
