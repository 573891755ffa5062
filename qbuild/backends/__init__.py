"""Compile backends: how one graph (a submodel at a bucket) becomes an artifact.

- export: a torch.export program (.pt2), weights as graph inputs; fast, for tests and for inspecting graphs.
- inductor: an AOTInductor package (.pt2) compiled to native CPU code from the same exported program.
- neuron: NxDI / neuronx-cc where the Neuron SDK is installed (neuron.py; its config translation is pure).

Nothing here imports torch at module level: the planner imports qbuild.backends.neuron for `plan --json`.
"""

from __future__ import annotations

BACKENDS = ("export", "inductor", "neuron")
CPU_BACKENDS = ("export", "inductor")


def graph_file(graph: str, bucket: int) -> str:
    """The file name of a compiled CPU graph, inside a compile output and under a bundle's graphs/."""
    return f"{graph}-{bucket}.pt2"


def hf_config(params: dict) -> dict:
    """An HF config.json rebuilt from the allow-listed architecture in compile params (never from a checkpoint).

    What the CPU backends build the reference model from and what NxDI's config loader reads.
    """
    if params["graph"] == "vision":
        v = params["vision"]
        # The image token ids are host-side facts (where features go), not part of the vision graph.
        return {"model_type": "qwen3_5", "image_token_id": -1, "vision_start_token_id": -1,
                "vision_config": {**v, "hidden_act": "gelu_pytorch_tanh", "in_channels": 3}}
    t = params["text"]
    text = {"model_type": {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}.get(t["family"], t["family"]),
            "vocab_size": t["vocab_size"], "hidden_size": t["hidden_size"], "num_hidden_layers": t["num_layers"],
            "layer_types": list(t["layer_types"]), "num_attention_heads": t["num_heads"],
            "num_key_value_heads": t["num_kv_heads"], "head_dim": t["head_dim"],
            "linear_num_key_heads": t["num_k_heads"], "linear_num_value_heads": t["num_v_heads"],
            "linear_key_head_dim": t["k_head_dim"], "linear_value_head_dim": t["v_head_dim"],
            "linear_conv_kernel_dim": t["conv_kernel"], "rms_norm_eps": t["rms_norm_eps"],
            "rope_parameters": t["rope"], "tie_word_embeddings": t["tie_word_embeddings"], "hidden_act": "silu"}
    if t["intermediate_size"] is not None:
        text["intermediate_size"] = t["intermediate_size"]
    if t["num_experts"] is not None:
        text.update(num_experts=t["num_experts"], num_experts_per_tok=t["num_experts_per_tok"],
                    moe_intermediate_size=t["moe_intermediate_size"],
                    shared_expert_intermediate_size=t["shared_intermediate_size"])
        text.update(norm_topk_prob=t.get("norm_topk_prob", True), decoder_sparse_step=t.get("decoder_sparse_step", 1),
                    mlp_only_layers=list(t.get("mlp_only_layers", [])))
    if t["family"] == "qwen3_next":
        return text
    return {"model_type": t["family"], "text_config": text, "tie_word_embeddings": t["tie_word_embeddings"]}
