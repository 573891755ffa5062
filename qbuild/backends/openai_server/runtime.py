"""What qbuild's OpenAI-compatible server (serve.py) asks of the runtime it serves: one loaded bundle that tokenizes,
checks lengths, places an image's tokens and generates greedily. The CPU backends' qbuild.model.runtime.Runtime and a
neuron VL bundle's qbuild.backends.neuron.vl_runtime.NeuronVLRuntime are the two; the server never asks which."""

from __future__ import annotations

from typing import Callable, Protocol


class Generated(Protocol):
    """One generation's outcome, as the server reports it."""

    token_ids: list[int]             # the generated tokens, the end-of-sequence token included where it came
    text: str                        # their text, special tokens skipped
    cached_tokens: int               # prompt tokens a prefix cache answered (0 without one)


class ServingRuntime(Protocol):
    tokenizer: object                # a transformers tokenizer: decode, chat_template, apply_chat_template
    arch: object                     # the model's architecture: vocab_size
    tkg: list[int]                   # token-generation buckets, ascending: the last is the KV length
    vision: object | None            # None: the bundle takes no images

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt the bundle takes."""

    def encode(self, prompt: str) -> list[int]: ...

    def eos_ids(self) -> set[int]:
        """The tokens that end a generation."""

    def check_prompt(self, n: int) -> object:
        """UserError naming the limit a prompt of `n` tokens exceeds."""

    def max_new_tokens_after(self, n: int) -> int:
        """The most tokens a prompt of `n` tokens can be followed by."""

    def check_lengths(self, n: int, max_new_tokens: int) -> object:
        """UserError naming the limit a prompt of `n` tokens followed by `max_new_tokens` exceeds."""

    def image_marker(self) -> list[int]:
        """Where an image goes in a prompt, as a chat template marks it."""

    def place_image(self, prompt_ids: list[int], image) -> list[int]:
        """The prompt with its one image marker expanded to the image's tokens; UserError otherwise."""

    def check_image_tokens(self, prompt_ids: list[int], image) -> None:
        """UserError unless the prompt's image tokens are exactly the image's."""

    def prepare_image(self, image: bytes, label: str | None = None):
        """An image read, checked and planned (its bucket or tiles); UserError naming `label` where it cannot be
        taken."""

    def generate(self, prompt_ids: list[int], max_new_tokens: int, *, prepared=None,
                 on_token: Callable[[int], bool | None] | None = None) -> Generated:
        """Greedy tokens after `prompt_ids` (and the `prepared` image whose tokens it holds); `on_token` sees each
        token as it is chosen, and a true return ends the generation there."""
