"""Load a bundle and generate with its compiled graphs: prefill through a CTE graph, greedy decode through the
token-generation graphs, images through the vision graph (VL bundles). CPU backends (export, inductor).

The host owns the full KV cache (qbuild.model.runtime.state); the graphs are loaded on first use
(qbuild.model.runtime.graphs). Weights are loaded once, into the reference model's rank-stacked layout the graphs take
as inputs.

A bundle with chunked prefill (bundle.json "long_context") prefills a prompt up to its KV length in pieces: the first
through a CTE graph, each later one through an extend graph that continues the state (qbuild.model.chunking says
where the pieces are cut). With a prefix cache (qbuild.model.runtime.prefix_cache), a prompt resumes from the
deepest cached checkpoint of its prefix and runs the remaining pieces exactly as a cold prefill runs them, so its
tokens are the cold prefill's, bit for bit.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from qbuild.model.chunking import EXTEND, LongContext, kv_bucket, pieces
from qbuild.model.runtime.graphs import Graphs
from qbuild.model.runtime.images import EncodedImage, ImageSource, PreparedImage
from qbuild.model.runtime.state import HostState
from qbuild.model.bundle import check_files, read_manifest, shown_path
from qbuild.model.runtime.prompts import PromptRules
from qbuild.core.errors import UserError


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    ttft_ms: float
    tpot_ms: float | None            # None when only one token was generated
    cte_bucket: int                  # the CTE bucket of the prompt's (first) prefill piece
    prefill_logits: object = field(repr=False, default=None)   # (n - cached_tokens, V) float32 tensor of row 0
    cached_tokens: int = 0           # prompt tokens taken from the prefix cache (their logits are not computed)


class Runtime(PromptRules):
    """A loaded bundle. Build with `Runtime.load(dir)`; call `generate(...)`. Its prompt rules are PromptRules', its
    prompt limit the KV length where it prefills in chunks."""

    def __init__(self, root: Path, manifest: dict, config: dict, tokenizer, weights: dict, arch, vision,
                 shown_as: str | None = None):
        self.root, self.manifest, self.config, self.tokenizer = root, manifest, config, tokenizer
        self.shown = shown_as or str(root)     # how errors name the bundle
        self.weights, self.arch, self.vision = weights, arch, vision
        self.batch = manifest["batch_size"]
        self.cte = sorted(manifest["buckets"]["cte"])
        self.tkg = sorted(manifest["buckets"]["tkg"])
        self.vision_buckets = sorted(manifest["buckets"].get("vision", []))
        self.graphs = Graphs(root, manifest)
        self.embeds = self.graphs.signature(f"cte-{self.cte[0]}")["embeds"]
        self.long_context = LongContext.from_json(manifest.get("long_context"))
        self.state = HostState(self.graphs.signature(f"cte-{self.cte[0]}"), self.tkg[-1])
        self.prefix_cache = self.state.prefix_cache(self.long_context)

    # --- loading ---------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, root: Path, *, verify_digests: bool = True, shown_as: str | None = None) -> "Runtime":
        """The bundle at `root`. Errors name it `shown_as` (default: `root`): a locked recipe's bundle laid out in a
        temporary directory is named by the recipe (qbuild.execution.transfer.open_locked_bundle)."""
        root = Path(root)
        # The bundle is checked before torch is imported, so a bad one is refused at once. Which runtime runs a bundle
        # is its backend's answer (qbuild.backends.load_runtime): this one runs the CPU backends'.
        manifest = read_manifest(root, shown_as)
        check_files(root, manifest, digests=verify_digests, shown_as=shown_as)

        import torch
        from safetensors.torch import load_file

        from qbuild.model.arch import arch_from_config
        from qbuild.model.modeling import TextModel

        config = json.loads((root / "config.json").read_text())
        arch = arch_from_config(config)
        dtype = getattr(torch, manifest["dtype"])
        model = TextModel(arch, tp=manifest["tp"], ep=manifest["ep"], dtype=dtype,
                          max_seq_len=max(manifest["buckets"]["cte"]))
        shards = [load_file(root / "weights" / f"tp{r}_sharded_checkpoint.safetensors")
                  for r in range(manifest["tp"])]
        try:
            model.load_shards(shards)
        except ValueError as e:
            raise UserError(f"{shown_path(root, 'weights', shown_as)}: {e}") from None
        weights = dict(model.state_dict())
        vision = _load_vision(root, arch, config, dtype) if manifest["buckets"].get("vision") else None
        return cls(root, manifest, config, _tokenizer(root, shown_as), weights, arch, vision, shown_as)

    def graph(self, name: str):
        """The callable of one compiled graph, loaded on first use."""
        return self.graphs.get(name)

    # --- text --------------------------------------------------------------------------------------------------
    def _tkg_bucket(self, position: int) -> int:
        return next(b for b in self.tkg if b > position)

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt: the KV length with chunked prefill, else the largest CTE bucket (PromptRules')."""
        return self.tkg[-1] if self.long_context else self.cte[-1]

    def check_prompt(self, n: int) -> int:
        """The CTE bucket of the first prefill piece of a prompt of `n` tokens; UserError naming the limit it
        exceeds."""
        if n == 0:
            raise UserError("the prompt is empty")
        if self.long_context is None:
            return self.cte_bucket(n)
        if n > self.tkg[-1]:
            raise UserError(f"the prompt has {n} tokens, more than the {self.tkg[-1]} KV slots of this bundle "
                            "(its largest token-generation bucket); shorten it or build a recipe with a longer "
                            "seq_len")
        return self.cte_bucket(self._pieces(n)[0][1])

    def _pieces(self, n: int) -> list[tuple[int, int]]:
        """[start, end) of each prefill piece of a prompt of n tokens (qbuild.model.chunking). Without a prefix
        cache, a prompt that fits a CTE bucket is one piece; with one, every prompt is cut on the same grid, so a
        resumed prefill runs the pieces a cold one ran."""
        plan = self.long_context
        if plan is None or (plan.prefix_cache is None and n <= self.cte[-1]):
            return [(0, n)]
        return pieces(n, plan.step)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, *, image: Path | None = None,
                 prepared: PreparedImage | None = None, stop_at_eos: bool = True,
                 on_token: Callable[[int], bool | None] | None = None, use_cache: bool = True) -> Generation:
        """Greedy generation of up to `max_new_tokens` tokens after `prompt_ids` (with an image, if given).
        `image`: an image file, whose tokens go where the prompt holds one <|image_pad|> (as a chat template marks an
        image), else in front of the prompt (image_tokens); `prepared`: an image (prepare_image) whose tokens the
        prompt already holds where they belong (place_image). `on_token` is called
        with each token as it is chosen; a true return ends the generation there. With `use_cache` false the prefix
        cache is neither read nor written (the tokens are the same)."""
        import torch

        if max_new_tokens < 1:
            raise UserError("--max-new-tokens must be at least 1")
        if image is not None:
            prepared = self.prepare_image(image)
            marked = self.arch.image_token_id in prompt_ids
            prompt_ids = self.place_image(list(prompt_ids), prepared) if marked else \
                self.image_tokens(prepared) + list(prompt_ids)
        self.check_image_tokens(prompt_ids, prepared)
        n = len(prompt_ids)
        bucket = self.check_lengths(n, max_new_tokens)
        eos = self.eos_ids() if stop_at_eos else set()
        self._load_graphs(n, max_new_tokens)  # before the clock starts: TTFT is a serving figure
        encoded = self.vision.run(prepared, self.graph) if prepared is not None else None
        with torch.no_grad():
            start = time.perf_counter()
            logits, state, deltas, cached = self._prefill(prompt_ids, encoded, use_cache)
            token = int(logits[-1].argmax())
            ttft = time.perf_counter() - start
            tokens, steps = [token], []
            stop = bool(on_token and on_token(token))
            for i in range(max_new_tokens - 1):
                if token in eos or stop:
                    break
                step = time.perf_counter()
                out, state = self._decode(token, n + i, state, deltas)
                token = int(out[0, 0].argmax())
                tokens.append(token)
                steps.append(time.perf_counter() - step)
                stop = bool(on_token and on_token(token))
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return Generation(prompt_ids=list(prompt_ids), token_ids=tokens, text=text, ttft_ms=ttft * 1e3,
                          tpot_ms=(sum(steps) / len(steps) * 1e3) if steps else None, cte_bucket=bucket,
                          prefill_logits=logits.float(), cached_tokens=cached)

    def _load_graphs(self, n: int, max_new_tokens: int) -> None:
        """Every graph a cold prefill of n tokens and the decode after it can call."""
        pieces_ = self._pieces(n)
        self.graph(f"cte-{self.cte_bucket(pieces_[0][1])}")
        for start, _ in pieces_[1:]:
            self.graph(f"{EXTEND}-{kv_bucket(start + self.long_context.step, self.tkg)}")
        for b in {self._tkg_bucket(p) for p in range(n, n + max_new_tokens - 1)}:
            self.graph(f"tkg-{b}")

    # --- prefill ---------------------------------------------------------------------------------------------
    def _prefill(self, prompt_ids: list[int], images: EncodedImage | None, use_cache: bool):
        """Every prefill piece of the prompt not taken from the prefix cache; the cache gets the checkpoints and
        blocks of this prompt. images: the encoded image whose M pad tokens the prompt holds, or None.
        -> (logits (n - cached, V) of row 0, the host's state, mRoPE deltas (B,), cached tokens)."""
        import torch

        n = len(prompt_ids)
        plan = self._pieces(n)
        tokens, positions, deltas = self._prompt_inputs(prompt_ids, images, self._padded_length(plan))
        cache = self.prefix_cache if use_cache else None
        use = cache.lookup(self._block_hashes(prompt_ids, images), n) if cache else None
        cached = use.tokens if use else 0
        state = self.state.resumed(self.prefix_cache, use) if cached else None
        outs = []
        for start, end in plan:
            if start < cached:
                continue
            if start == 0:
                logits, state = self._first_piece(tokens, positions, end)
            else:
                logits, state = self._extend(tokens, positions, start, end, state)
            outs.append(logits[0, :end - start])
            if use:
                cache.save_checkpoint(use, end, state)
        if use:
            cache.store(use, state)
        return torch.cat(outs), state, deltas, cached

    def _padded_length(self, plan: list[tuple[int, int]]) -> int:
        """The length the prompt's inputs are padded to: the first piece's CTE bucket, and every later piece's
        whole step."""
        ends = [self.cte_bucket(plan[0][1])] + [start + self.long_context.step for start, _ in plan[1:]]
        return max(ends)

    def _block_hashes(self, prompt_ids: list[int], images: EncodedImage | None) -> list[bytes]:
        """The prompt's block hash chain; an image's features are an extra key of the first block (its tokens in
        the prompt are image pad tokens, the same for every image). A tiled image's features are its four tiles' stitched together, so they key it
        the same way."""
        import hashlib

        from qbuild.model.runtime.prefix_cache import block_hashes

        salt = hashlib.sha256(images.features.float().contiguous().numpy().tobytes()).digest() if images else b""
        return block_hashes(prompt_ids, self.prefix_cache.spec.block_size, salt)

    def _prompt_inputs(self, prompt_ids: list[int], images: EncodedImage | None, length: int):
        """The prompt right-padded to `length` (with its last token), batch rows alike: (ids (B, length), or
        embeddings (B, length, H) for the VL families; positions (B, length) or mRoPE (3, B, length); mRoPE deltas
        (B,))."""
        import torch

        import numpy as np

        n = len(prompt_ids)
        # through numpy: torch.tensor walks a long list element by element, several times slower (a warm prompt's
        # time to the first token is mostly one graph call, so the host's share shows)
        ids = torch.from_numpy(np.array(prompt_ids + [prompt_ids[-1]] * (length - n), dtype=np.int64))[None]
        ids = ids.expand(self.batch, -1).contiguous()
        deltas = torch.zeros(self.batch, dtype=torch.long)
        if self.arch.mrope_section is not None:
            from qbuild.model.modeling.vision import mrope_position_ids

            grid = images.grid if images is not None else None
            seq_lens = torch.full((self.batch,), n, dtype=torch.long)
            positions, deltas = mrope_position_ids(ids, grid, self.arch, seq_lens)
        else:
            positions = torch.arange(length)[None].expand(self.batch, -1).contiguous()
        return (self._embed(ids, images) if self.embeds else ids), positions, deltas

    def _first_piece(self, tokens, positions, end: int):
        """The piece [0, end) through the CTE graph of its bucket; the state becomes the host's full caches."""
        import torch

        bucket = self.cte_bucket(end)
        seq_lens = torch.full((self.batch,), end, dtype=torch.long)
        logits, new = self.graph(f"cte-{bucket}")(self.weights, tokens[:, :bucket].contiguous(),
                                                  positions[..., :bucket].contiguous(), seq_lens)
        return logits, self.state.full(list(new), end)

    def _extend(self, tokens, positions, start: int, end: int, state: list):
        """The piece [start, end) through the extend graph of the KV bucket its step of slots needs."""
        import torch

        step = self.long_context.step
        bucket = kv_bucket(start + step, self.tkg)
        starts = torch.full((self.batch,), start, dtype=torch.long)
        seq_lens = torch.full((self.batch,), end - start, dtype=torch.long)
        return self.state.call(self.graph(f"{EXTEND}-{bucket}"), self.weights, bucket, state,
                               tokens[:, start:start + step].contiguous(), positions[..., start:start + step].contiguous(),
                               starts, seq_lens)

    def _embed(self, ids, images: EncodedImage | None):
        import torch.nn.functional as F

        table = self.weights["embed_tokens.weight"]
        if images is None:
            return F.embedding(ids, table)
        from qbuild.model.modeling.vision import embed_with_images

        per_row = images.features.repeat(ids.shape[0], 1)
        return embed_with_images(table, ids, per_row, self.arch.image_token_id)

    def _decode(self, token: int, position: int, state: list, deltas):
        import torch

        bucket = self._tkg_bucket(position)
        ids = torch.full((self.batch, 1), token, dtype=torch.long)
        positions = torch.full((self.batch,), position, dtype=torch.long)
        if self.arch.mrope_section is not None:
            from qbuild.model.modeling.vision import decode_position_ids

            position_ids = decode_position_ids(positions, deltas)
        else:
            position_ids = positions[:, None]
        return self.state.call(self.graph(f"tkg-{bucket}"), self.weights, bucket, state, ids, position_ids, positions)

    # --- images ------------------------------------------------------------------------------------------------
    def prepare_image(self, image: ImageSource, label: str | None = None) -> PreparedImage:
        """An image read, checked and cut into patches (qbuild.model.runtime.images), with the bucket (and tiling) it
        will run through; UserError naming it where this bundle cannot take it. Cheap next to encoding it, which
        `generate` does."""
        if self.vision is None:
            raise UserError(f"{self.shown}: this bundle has no vision graph; an image needs a VL recipe with "
                            "`vision: {buckets: [...]}`")
        return self.vision.prepare(image, self.vision_buckets, label)


def _tokenizer(root: Path, shown_as: str | None):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(root))
    except (OSError, ValueError) as e:
        raise UserError(f"{shown_as or root}: cannot load the bundle's tokenizer: {e}") from None


def _load_vision(root: Path, arch, config: dict, dtype):
    from qbuild.model.runtime.images import VisionRuntime

    return VisionRuntime.load(root, arch, config, dtype)
