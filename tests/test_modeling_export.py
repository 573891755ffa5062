"""torch.export of the text model's two entry points, which the compile backends trace.

One exported prefill graph serves every prompt that fits its bucket, and one exported decode graph serves every
step (the KV-cache write and the attention mask follow the `positions` input, not Python control flow): both must
give what the eager model gives, with the weights under their NxDI names.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qbuild.model.arch import arch_from_config
from qbuild.model.convert.convert import convert_state_dict
from qbuild.model.convert.shard import shard_state_dict
from qbuild.model.modeling import EntryPoint, TextModel, text_position_ids
from qbuild.model.ranks import RankLayout

BUCKET, MAX_SEQ_LEN, BATCH = 72, 96, 2
# The exported graph runs the same aten ops as eager; only kernel dispatch inside them may differ.
EXPORT_ATOL = 1e-6


def _loaded_model(path, tp: int, ep: int) -> TextModel:
    config = json.loads((path / "config.json").read_text())
    tensors = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}
    text, _ = convert_state_dict(config, tensors, dtype="float32")
    model = TextModel(arch_from_config(config), tp=tp, ep=ep, max_seq_len=MAX_SEQ_LEN).eval()
    model.load_shards(shard_state_dict(config, text, ranks=RankLayout.split(tp, ep)))
    return model


def _max_err(a, b) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(torch.utils._pytree.tree_leaves(a),
                                                                           torch.utils._pytree.tree_leaves(b)))


@pytest.mark.slow
@pytest.mark.parametrize("family,tp,ep", [("qwen3_5", 1, 1), ("qwen3_5_moe", 2, 2), ("qwen3_next", 2, 1)])
def test_prefill_and_decode_export(tiny_checkpoints, family, tp, ep):
    model = _loaded_model(tiny_checkpoints[family], tp, ep)
    gen = torch.Generator().manual_seed(0)
    mrope = model.arch.mrope_section is not None
    # VL families take embeddings (the host inserts image features) and (3, B, S) mRoPE positions.
    ids = torch.randint(0, 500, (BATCH, BUCKET), generator=gen)
    tokens = torch.nn.functional.embedding(ids, model.embed_tokens.weight) if mrope else ids
    positions = text_position_ids(BUCKET, BATCH)
    position_ids = positions[None].expand(3, -1, -1).contiguous() if mrope else positions
    seq_lens = torch.tensor([BUCKET, 9])
    with torch.no_grad():
        prefill = torch.export.export(EntryPoint(model, "prefill"), (tokens, position_ids, seq_lens), strict=False)
        expected_logits, state = model.prefill(tokens, position_ids, seq_lens)
        prefill_graph = prefill.module()
        assert _max_err(prefill_graph(tokens, position_ids, seq_lens), (expected_logits, state)) < EXPORT_ATOL
        # The same graph with other lengths: padding is masked by value, not by shape.
        other_lens = torch.tensor([30, 64])
        assert _max_err(prefill_graph(tokens, position_ids, other_lens),
                        model.prefill(tokens, position_ids, other_lens)) < EXPORT_ATOL

        token = expected_logits[torch.arange(BATCH), seq_lens - 1].argmax(-1)[:, None]
        slots = seq_lens.clone()
        decode_pos = slots[None, :, None].expand(3, -1, -1).contiguous() if mrope else slots[:, None]
        decode = torch.export.export(EntryPoint(model, "decode"), (token, decode_pos, slots, state), strict=False)
        graph = decode.module()
        exported_state, eager_state = state, state
        for _ in range(3):  # one graph, successive steps at different cache slots
            decode_pos = slots[None, :, None].expand(3, -1, -1).contiguous() if mrope else slots[:, None]
            exported_logits, exported_state = graph(token, decode_pos, slots, exported_state)
            eager_logits, eager_state = model.decode(token, decode_pos, slots, eager_state)
            assert _max_err((exported_logits, exported_state), (eager_logits, eager_state)) < EXPORT_ATOL
            token, slots = eager_logits[:, 0].argmax(-1)[:, None], slots + 1
    names = {n for n, _ in prefill.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}
    assert "layers.0.linear_attn.in_proj_qkv.weight" in names


@pytest.mark.slow
def test_saving_and_loading_shortcuts_give_what_torch_gives(tiny_checkpoints, tmp_path):
    """qbuild's saver (qbuild.model.runtime.exported) skips the canonical-form check torch throws away, and its loader
    reads each schema class's type hints once instead of once per deserialized object: the saved bytes must be the
    ones torch.export.save writes, the loaded program the one torch.export.load returns, the serializer must be left
    as it was, and both must apply to the pinned torch, where they make saving about twice and loading about three
    times faster."""
    from torch._export.serde import serialize

    from qbuild.model.runtime import exported

    model = _loaded_model(tiny_checkpoints["qwen3_next"], 2, 1)
    ids = torch.randint(0, 500, (BATCH, BUCKET), generator=torch.Generator().manual_seed(1))
    positions, seq_lens = text_position_ids(BUCKET, BATCH), torch.tensor([BUCKET, 9])
    with torch.no_grad():
        program = torch.export.export(EntryPoint(model, "prefill"), (ids, positions, seq_lens), strict=False)
    path = str(tmp_path / "prefill.pt2")
    torch.export.save(program, path)
    assert exported._canonicalize_is_a_discarded_check(), "torch's serializer changed shape: the saver no longer applies"
    check = serialize.canonicalize
    (tmp_path / "ours").mkdir()
    exported.save(program, tmp_path / "ours" / "prefill.pt2")
    assert serialize.canonicalize is check
    assert (tmp_path / "ours" / "prefill.pt2").read_bytes() == Path(path).read_bytes()

    plain = torch.export.load(path)
    assert exported._memoize_schema_hints(), "torch's serializer changed shape: the loader no longer applies"
    ours = exported.load(path)
    hints = serialize.typing._hints.cache_info()
    assert hints.hits > 10 * hints.misses > 0
    assert ours.graph_module.code == plain.graph_module.code
    assert ours.graph_signature == plain.graph_signature
    assert ours.module_call_graph == plain.module_call_graph
    assert ours.range_constraints == plain.range_constraints
    assert ours.state_dict.keys() == plain.state_dict.keys()
    assert all(torch.equal(ours.state_dict[k], plain.state_dict[k]) for k in plain.state_dict)
    other_lens = torch.tensor([30, 64])
    with torch.no_grad():
        assert _max_err(ours.module()(ids, positions, other_lens), plain.module()(ids, positions, other_lens)) == 0
