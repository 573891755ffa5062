"""Token embeddings and the LM head: tied embeddings and the Coder-Next pad-row zeroing (docs/nxd-layout.md
sections 0 and 3)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:   # the rules import torch where they run it: a header check builds their tables without it
    import torch

from qbuild.model.convert.rule import Step, rule_name, same


def zero_row(w: torch.Tensor, row: int) -> torch.Tensor:
    """A copy of `w` with row `row` zeroed: right-padding tokens then embed to zero and cannot disturb the
    DeltaNet recurrence (the Coder-Next port's choice; the main lineage masks padding inside DeltaNet instead)."""
    out = w.clone()
    out[row] = 0
    return out


def embedding_steps(d, family, hf_prefix: str, names) -> list[Step]:
    """embed_tokens (and lm_head). When lm_head.weight is absent and the config ties embeddings, the head is a copy
    of the (converted) embedding; when it is absent and untied, the lm_head step stays so validation reports it."""
    shape = (d.vocab_size, d.hidden_size)
    pad = d.pad_token_id if family.zero_pad_embedding and d.pad_token_id is not None else None
    tied_copy = "lm_head.weight" not in names and d.tie_word_embeddings
    targets = ("embed_tokens.weight", "lm_head.weight") if tied_copy else ("embed_tokens.weight",)

    def embed(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        w = zero_row(w, pad) if pad is not None else w
        return (w, w.clone()) if tied_copy else (w,)

    steps = [Step((f"{hf_prefix}embed_tokens.weight",), (shape,), targets, embed,
                  rule="embeddings.embedding_steps", args=(("zero_row", pad), ("tied_copy", tied_copy)))]
    if not tied_copy:
        steps.append(Step(("lm_head.weight",), (shape,), ("lm_head.weight",), lambda w: same(d, w),
                          rule=rule_name(same)))
    return steps
