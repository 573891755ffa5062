"""qbuild.model.arch is the one reader of config.json: both config forms, the VL wrapper and its text-only export give
the same Arch; the converter's and the reference model's views derive from it; bad fields fail in one line naming
config.json and the field. Pure JSON: no torch, no checkpoint."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from qbuild.model.arch import Arch, ConfigError, arch_from_config
from qbuild.core.errors import UserError
from qbuild.hub.source import shipped_config_path
from tests.conftest import REPO

_TEXT = dict(vocab_size=512, hidden_size=64, num_hidden_layers=8, rms_norm_eps=1e-6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, intermediate_size=96)
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
_LAYER_TYPES = (["linear_attention"] * 3 + ["full_attention"]) * 2
_VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64, patch_size=16,
               temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=64, in_channels=3,
               hidden_act="gelu_pytorch_tanh", rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})


def _next(form: str, **extra) -> dict:
    """A qwen3_next config in the transformers-5 form ("new") or the older published form ("old")."""
    config = dict(_TEXT, **_MOE, model_type="qwen3_next", norm_topk_prob=False, decoder_sparse_step=1,
                  mlp_only_layers=[2], pad_token_id=7, **extra)
    if form == "new":
        config.update(rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.25},
                      layer_types=list(_LAYER_TYPES))
    else:
        config.update(rope_theta=5000000, partial_rotary_factor=0.25, full_attention_interval=4)
    return config


def _vl(family: str = "qwen3_5", form: str = "new") -> dict:
    text = dict(_TEXT, model_type=f"{family}_text", pad_token_id=5)
    if family == "qwen3_5_moe":
        text.update(_MOE)
    if form == "new":
        text.update(rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
                    layer_types=list(_LAYER_TYPES))
    else:  # top-level rope_theta / partial_rotary_factor, mrope in rope_scaling, no layer_types
        text.update(rope_theta=1e7, partial_rotary_factor=0.25, full_attention_interval=4,
                    rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    return {"model_type": family, "text_config": text, "vision_config": dict(_VISION), "tie_word_embeddings": False,
            "image_token_id": 510, "vision_start_token_id": 508}


def _error(config: dict) -> str:
    with pytest.raises(ConfigError) as info:
        arch_from_config(config, "/ckpt/config.json")
    message = str(info.value)
    assert isinstance(info.value, UserError) and isinstance(info.value, ValueError)
    assert "\n" not in message and message.startswith("/ckpt/config.json: "), message
    return message


def test_both_config_forms_give_the_same_arch():
    new, old = arch_from_config(_next("new")), arch_from_config(_next("old"))
    assert new == old and new.fingerprint() == old.fingerprint()
    assert new.layer_types == tuple(_LAYER_TYPES)
    assert new.rope_params == {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.25}
    assert (new.norm_topk_prob, new.mlp_only_layers, new.pad_token_id, new.intermediate_size) == (False, (2,), 7, 96)
    assert sorted(new.moe_layers) == [0, 1, 3, 4, 5, 6, 7]
    for family in ("qwen3_5", "qwen3_5_moe"):
        new, old = arch_from_config(_vl(family, "new")), arch_from_config(_vl(family, "old"))
        assert new == old
        assert new.rope_params["mrope_section"] == (2, 1, 1) and new.rope_params["mrope_interleaved"] is True
    # rope_parameters wins over older top-level fields where a config carries both.
    both = dict(_next("new"), rope_theta=1.0)
    assert arch_from_config(both).rope_params["rope_theta"] == 5e6


def test_vl_wrapper_and_text_only_export_describe_the_same_text_model():
    for family in ("qwen3_5", "qwen3_5_moe"):
        wrapper = _vl(family)
        text_only = dict(wrapper["text_config"], tie_word_embeddings=False)
        vl, text = arch_from_config(wrapper), arch_from_config(text_only)
        assert vl.family == text.family == family and text.vision is None
        assert vl.vision is not None and (vl.vision.depth, vl.vision.in_channels) == (2, 3)
        assert (vl.image_token_id, vl.vision_start_token_id) == (510, 508) and text.image_token_id is None
        fp_vl, fp_text = vl.fingerprint(), text.fingerprint()
        fp_vl.pop("vision"), fp_text.pop("vision")
        assert fp_vl == fp_text  # the text graphs' compile keys do not depend on the wrapper
    # Qwen3.5-MoE has no dense-layer fields (transformers drops them): every layer is MoE, no dense MLP size.
    moe = _vl("qwen3_5_moe")
    moe["text_config"].update(mlp_only_layers=[1], decoder_sparse_step=2)
    arch = arch_from_config(moe)
    assert arch.moe_layers == frozenset(range(8)) and arch.intermediate_size is None


def test_missing_or_bad_field_names_config_json_and_the_field():
    config = _vl()
    del config["text_config"]["linear_num_value_heads"]
    assert "text_config.linear_num_value_heads is missing" in _error(config)
    config = _next("new")
    del config["num_hidden_layers"]
    assert "num_hidden_layers is missing (model_type qwen3_next" in _error(config)
    assert "text_config is missing" in _error({"model_type": "qwen3_5"})
    assert "model_type 'llama' is not supported" in _error({"model_type": "llama"})
    config = _vl()
    config["text_config"]["hidden_size"] = "64"
    assert "text_config.hidden_size must be a valid integer, got '64'" in _error(config)
    assert "layer_types must list" in _error(dict(_next("new"), layer_types=["full_attention"]))
    assert "rope_type 'yarn' is not supported" in _error(dict(_next("new"), rope_parameters={"rope_type": "yarn"}))
    config = _vl()
    config["vision_config"]["hidden_act"] = "gelu"
    assert "vision_config.hidden_act must be 'gelu_pytorch_tanh', got 'gelu'" in _error(config)
    config = _vl()
    del config["vision_config"]["depth"]
    assert "vision_config.depth is missing" in _error(config)


def test_fingerprint_round_trips_and_excludes_host_side_fields():
    for config in (_next("old"), _vl("qwen3_5"), _vl("qwen3_5_moe")):
        arch = arch_from_config(config)
        fp = json.loads(json.dumps(arch.fingerprint()))  # compile params travel as JSON
        assert not set(Arch.HOST_FIELDS) & fp.keys()
        rebuilt = Arch.from_fingerprint(fp)
        assert rebuilt.fingerprint() == arch.fingerprint()
        # to_hf_config writes a config.json (what NxDI reads) that reads back to the same architecture.
        assert arch_from_config(arch.to_hf_config()) == arch
        assert arch_from_config(rebuilt.to_hf_config()).fingerprint() == arch.fingerprint()
        text_only = dict(fp)
        text_only.pop("vision")  # the text graphs' params carry no vision encoder
        assert Arch.from_fingerprint(text_only).vision is None


def test_shipped_configs_read_and_round_trip():
    for repo in ("Qwen/Qwen3.5-27B", "Qwen/Qwen3.5-35B-A3B", "Qwen/Qwen3-Coder-Next"):
        arch = arch_from_config(json.loads(shipped_config_path(repo).read_text()))
        assert Arch.from_fingerprint(arch.fingerprint()) == Arch.from_fingerprint(
            json.loads(json.dumps(arch.fingerprint())))


def test_converter_reads_the_one_arch():
    from qbuild.model.convert.checkpoint import arch_of
    from qbuild.model.convert.errors import CheckpointError

    config = _vl("qwen3_5_moe", "old")
    arch = arch_from_config(config)
    family, read = arch_of(config)
    assert (family.name, read) == ("qwen3_5_moe", arch)
    assert (arch.pad_token_id, arch.intermediate_size, arch.text_model_type) == (5, None, "qwen3_5_moe_text")
    assert (arch.rotary_dim, arch.mrope_section, arch.mrope_interleaved) == (8, (2, 1, 1), True)
    assert arch.moe_layers == frozenset(range(arch.num_layers))
    assert (arch.vision.in_channels, arch.vision.spatial_merge_size, arch.image_token_id, arch.vision_rope_theta) == \
        (3, 2, 510, 10000.0)
    broken = copy.deepcopy(config)
    broken["text_config"]["num_attention_heads"] = -1
    with pytest.raises(CheckpointError) as info:
        arch_of(broken)
    assert str(info.value).startswith("config.json: text_config.num_attention_heads must be greater than 0, got -1")


def test_arch_imports_without_torch():
    code = ("import sys, qbuild.model.arch, qbuild.backends, qbuild.model.families\n"
            "heavy = [m for m in ('torch', 'transformers', 'safetensors', 'pydantic', 'yaml', 'qbuild.recipe.schema')\n"
            "         if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
