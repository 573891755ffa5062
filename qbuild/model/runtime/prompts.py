"""The rules of a bundle's prompts that every runtime serving it shares: tokenizing, the end-of-sequence tokens, the
lengths its buckets take, and where an image's tokens go. A runtime mixes PromptRules in and has `root`, `tokenizer`,
`config` (the bundle's config.json), `arch`, `cte` and `tkg` (its context-encoding and token-generation buckets,
ascending); check_prompt and max_prompt_tokens hold a prompt to the largest context-encoding bucket, which a runtime
that prefills in chunks overrides."""

from __future__ import annotations

import json

from qbuild.core.errors import UserError


class PromptRules:
    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def eos_ids(self) -> set[int]:
        """The tokens that end a generation: the bundle's generation_config.json's and the tokenizer's."""
        ids = set()
        gen = self.root / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # --- lengths -----------------------------------------------------------------------------------------------
    def cte_bucket(self, n: int) -> int:
        fits = [b for b in self.cte if b >= n]
        if not fits:
            raise UserError(f"the prompt has {n} tokens, more than the largest context-encoding bucket "
                            f"{self.cte[-1]} of this bundle; shorten it or build a recipe with a larger bucket")
        return fits[0]

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt: the largest context-encoding bucket."""
        return self.cte[-1]

    def check_prompt(self, n: int) -> int:
        """The context-encoding bucket of a prompt of `n` tokens; UserError naming the limit it exceeds."""
        if n == 0:
            raise UserError("the prompt is empty")
        return self.cte_bucket(n)

    def max_new_tokens_after(self, n: int) -> int:
        """The most tokens a prompt of `n` tokens can be followed by: the last one is never written to the cache."""
        return self.tkg[-1] - n + 1

    def check_lengths(self, n: int, max_new_tokens: int) -> int:
        """The context-encoding bucket a prompt of `n` tokens followed by `max_new_tokens` tokens runs in (its first
        piece, where the runtime prefills in chunks); UserError naming the limit it exceeds. A server checks a request
        with it before answering, so a refusal is an error status, never a stream cut short."""
        if max_new_tokens < 1:
            raise UserError("--max-new-tokens must be at least 1")
        bucket = self.check_prompt(n)
        kv_len = self.tkg[-1]
        if n + max_new_tokens - 1 > kv_len:
            raise UserError(f"a prompt of {n} tokens plus {max_new_tokens} new tokens needs {n + max_new_tokens - 1} "
                            f"KV slots; this bundle's largest token-generation bucket is {kv_len}")
        return bucket

    # --- where an image's tokens go ----------------------------------------------------------------------------
    def image_tokens(self, image) -> list[int]:
        """<|vision_start|> <|image_pad|> x the image's merged tokens <|vision_end|>."""
        return self.place_image(self.image_marker(), image)

    def image_marker(self) -> list[int]:
        """<|vision_start|> <|image_pad|> <|vision_end|>: where an image goes in a prompt, as a chat template marks it
        before the processor expands it."""
        end = self.config.get("vision_end_token_id") or self.tokenizer.convert_tokens_to_ids("<|vision_end|>")
        return [self.arch.vision_start_token_id, self.arch.image_token_id, end]

    def place_image(self, prompt_ids: list[int], image) -> list[int]:
        """A prompt that marks where the image goes with one <|image_pad|> (as a chat template renders an image part)
        with that token repeated once per merged token of the image (`image.tokens`), as transformers' Qwen3-VL
        processor expands it. UserError unless the prompt holds exactly one."""
        pad = self.arch.image_token_id
        if prompt_ids.count(pad) != 1:
            raise UserError(f"the prompt marks {prompt_ids.count(pad)} places for an image; the image goes where one "
                            "<|image_pad|> token stands")
        at = prompt_ids.index(pad)
        return prompt_ids[:at] + [pad] * image.tokens + prompt_ids[at + 1:]

    def check_image_tokens(self, prompt_ids: list[int], image) -> None:
        """UserError unless the prompt's image tokens are exactly the image's (none without an image): an image token
        typed into a text prompt has no features to stand for."""
        pad = self.arch.image_token_id
        held = prompt_ids.count(pad) if pad is not None else 0
        wanted = image.tokens if image is not None else 0
        if held != wanted:
            what = f"an image of {wanted} tokens" if image is not None else "no image"
            raise UserError(f"the prompt holds {held} image tokens (<|image_pad|>) and there is {what}")
