"""Load a bundle and generate with its compiled graphs: prefill through a CTE graph, greedy decode through the
token-generation graphs, images through the vision graph (VL bundles). CPU backends (export, inductor).

The host owns the full KV cache (seq_len slots, as NxDI's); each graph was compiled with its bucket as KV length,
so a call gets the cache sliced to that bucket and the result is written back. DeltaNet states do not depend on
the bucket. Weights are loaded once, into the reference model's rank-stacked layout the graphs take as inputs.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from qbuild.store.bundle import check_files, read_manifest
from qbuild.core.errors import UserError


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    ttft_ms: float
    tpot_ms: float | None            # None when only one token was generated
    cte_bucket: int
    prefill_logits: object = field(repr=False, default=None)   # (n, V) float32 tensor of row 0


class Runtime:
    """A loaded bundle. Build with `Runtime.load(dir)`; call `generate(...)`."""

    def __init__(self, root: Path, manifest: dict, config: dict, tokenizer, weights: dict, arch, vision):
        self.root, self.manifest, self.config, self.tokenizer = root, manifest, config, tokenizer
        self.weights, self.arch, self.vision = weights, arch, vision
        self.batch = manifest["batch_size"]
        self.cte = sorted(manifest["buckets"]["cte"])
        self.tkg = sorted(manifest["buckets"]["tkg"])
        self.vision_buckets = sorted(manifest["buckets"].get("vision", []))
        self._graphs: dict[str, object] = {}
        self._signatures: dict[str, dict] = {}
        self.embeds = self.signature(f"cte-{self.cte[0]}")["embeds"]

    # --- loading ---------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, root: Path, *, verify_digests: bool = True) -> "Runtime":
        root = Path(root)
        # The bundle is checked before torch is imported, so a bad one is refused at once.
        manifest = read_manifest(root)
        # A CPU bundle's graphs are under graphs/; a neuron bundle's compiled model is NxDI's model.pt.
        if not all(path.startswith("graphs/") for path in manifest.get("graphs", {}).values()):
            raise UserError(f"{root}: a neuron bundle runs on a Neuron host through NxDI, not on this runtime")
        check_files(root, manifest, digests=verify_digests)

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
            raise UserError(f"{root / 'weights'}: {e}") from None
        weights = dict(model.state_dict())
        vision = _load_vision(root, arch, config, dtype) if manifest["buckets"].get("vision") else None
        return cls(root, manifest, config, _tokenizer(root), weights, arch, vision)

    def signature(self, name: str) -> dict:
        """A graph's call signature, written beside it by its compile (qbuild.backends.cpu)."""
        if name not in self._signatures:
            self._signatures[name] = json.loads((self.root / "graphs" / f"{name}.json").read_text())
        return self._signatures[name]

    def graph(self, name: str):
        """The callable of one compiled graph, loaded on first use."""
        if name not in self._graphs:
            path = self.root / self.manifest["graphs"][name]
            self._graphs[name] = _load_graph(path, self.signature(name)["format"])
        return self._graphs[name]

    # --- text --------------------------------------------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def cte_bucket(self, n: int) -> int:
        fits = [b for b in self.cte if b >= n]
        if not fits:
            raise UserError(f"the prompt has {n} tokens, more than the largest context-encoding bucket "
                            f"{self.cte[-1]} of this bundle; shorten it or build a recipe with a larger bucket")
        return fits[0]

    def _tkg_bucket(self, position: int) -> int:
        return next(b for b in self.tkg if b > position)

    def max_new_tokens_after(self, n: int) -> int:
        """The most tokens a prompt of `n` tokens can be followed by: the last one is never written to the cache."""
        return self.tkg[-1] - n + 1

    def check_lengths(self, n: int, max_new_tokens: int) -> int:
        """The CTE bucket a prompt of `n` tokens followed by `max_new_tokens` tokens runs in; UserError naming the limit
        it exceeds. A server checks a request with it before answering, so a refusal is an error status, never a
        stream cut short."""
        if max_new_tokens < 1:
            raise UserError("--max-new-tokens must be at least 1")
        if n == 0:
            raise UserError("the prompt is empty")
        bucket = self.cte_bucket(n)
        kv_len = self.tkg[-1]
        if n + max_new_tokens - 1 > kv_len:
            raise UserError(f"a prompt of {n} tokens plus {max_new_tokens} new tokens needs {n + max_new_tokens - 1} "
                            f"KV slots; this bundle's largest token-generation bucket is {kv_len}")
        return bucket

    def generate(self, prompt_ids: list[int], max_new_tokens: int, *, image: Path | None = None,
                 stop_at_eos: bool = True, on_token: Callable[[int], bool | None] | None = None) -> Generation:
        """Greedy generation of up to `max_new_tokens` tokens after `prompt_ids` (with an image, if given).
        `on_token` is called with each token as it is chosen; a true return ends the generation there."""
        import torch

        if max_new_tokens < 1:
            raise UserError("--max-new-tokens must be at least 1")
        images = None
        if image is not None:
            prompt_ids, images = self.with_image_tokens(prompt_ids, image)
        n = len(prompt_ids)
        bucket = self.check_lengths(n, max_new_tokens)
        kv_len = self.tkg[-1]
        eos = self.eos_ids() if stop_at_eos else set()
        self.graph(f"cte-{bucket}")  # graphs load before the clock starts: TTFT is a serving figure
        for b in {self._tkg_bucket(p) for p in range(n, n + max_new_tokens - 1)}:
            self.graph(f"tkg-{b}")
        with torch.no_grad():
            start = time.perf_counter()
            logits, state, deltas = self._prefill(prompt_ids, bucket, images)
            token = int(logits[0, n - 1].argmax())
            ttft = time.perf_counter() - start
            tokens, steps = [token], []
            stop = bool(on_token and on_token(token))
            state = self._full_cache(state, kv_len)
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
                          prefill_logits=logits[0, :n].float())

    def eos_ids(self) -> set[int]:
        ids = set()
        gen = self.root / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def _prefill(self, prompt_ids: list[int], bucket: int, images: tuple | None):
        """images: (features (M, H), grid_thw) of the image whose M pad tokens the prompt holds, or None."""
        import torch

        n = len(prompt_ids)
        ids = torch.tensor(prompt_ids + [prompt_ids[-1]] * (bucket - n), dtype=torch.long)[None]
        ids = ids.expand(self.batch, -1).contiguous()
        seq_lens = torch.full((self.batch,), n, dtype=torch.long)
        deltas = torch.zeros(self.batch, dtype=torch.long)
        if self.arch.mrope_section is not None:
            from qbuild.model.modeling.vision import mrope_position_ids

            grid = images[1] if images is not None else None
            positions, deltas = mrope_position_ids(ids, grid, self.arch, seq_lens)
        else:
            positions = torch.arange(bucket)[None].expand(self.batch, -1).contiguous()
        if self.embeds:
            tokens = self._embed(ids, images)
        else:
            tokens = ids
        logits, state = self.graph(f"cte-{bucket}")(self.weights, tokens, positions, seq_lens)
        return logits, list(state), deltas

    def _embed(self, ids, images: tuple | None):
        import torch.nn.functional as F

        table = self.weights["embed_tokens.weight"]
        if images is None:
            return F.embedding(ids, table)
        from qbuild.model.modeling.vision import embed_with_images

        per_row = images[0].repeat(ids.shape[0], 1)
        return embed_with_images(table, ids, per_row, self.arch.image_token_id)

    def _attention_slots(self) -> list[int]:
        sig = self.signature(f"cte-{self.cte[0]}")
        return [i for i, name in enumerate(sig["state_names"]) if name.endswith(("k_cache", "v_cache"))]

    def _full_cache(self, state: list, kv_len: int) -> list:
        """Prefill's caches (KV length = its bucket) -> the host's full caches of kv_len slots."""
        import torch

        for i in self._attention_slots():
            cache = state[i]
            full = torch.zeros(*cache.shape[:3], kv_len, cache.shape[4], dtype=cache.dtype)
            keep = min(kv_len, cache.shape[3])
            full[:, :, :, :keep] = cache[:, :, :, :keep]
            state[i] = full
        return state

    def _decode(self, token: int, position: int, state: list, deltas):
        import torch

        bucket = self._tkg_bucket(position)
        slots = self._attention_slots()
        args = [s[:, :, :, :bucket].contiguous() if i in slots else s for i, s in enumerate(state)]
        ids = torch.full((self.batch, 1), token, dtype=torch.long)
        positions = torch.full((self.batch,), position, dtype=torch.long)
        if self.arch.mrope_section is not None:
            from qbuild.model.modeling.vision import decode_position_ids

            position_ids = decode_position_ids(positions, deltas)
        else:
            position_ids = positions[:, None]
        logits, new = self.graph(f"tkg-{bucket}")(self.weights, ids, position_ids, positions, tuple(args))
        new = list(new)
        for i in slots:
            state[i][:, :, :, :bucket] = new[i]
        for i in range(len(state)):
            if i not in slots:
                state[i] = new[i]
        return logits, state

    # --- images ------------------------------------------------------------------------------------------------
    def with_image_tokens(self, prompt_ids: list[int], image: Path) -> tuple[list[int], tuple]:
        """Encode `image` through the vision graph. Returns the prompt with the image's tokens in front
        (<|vision_start|> <|image_pad|> x merged tokens <|vision_end|> prompt) and (features, grid_thw)."""
        if self.vision is None:
            raise UserError(f"{self.root}: this bundle has no vision graph; --image needs a VL recipe with "
                            "`vision: {buckets: [...]}`")
        features, grid = self.vision.encode(image, self.vision_buckets, self.graph)
        arch = self.arch
        vision_end = self.config.get("vision_end_token_id") or self.tokenizer.convert_tokens_to_ids("<|vision_end|>")
        ids = [arch.vision_start_token_id] + [arch.image_token_id] * features.shape[0] + [vision_end] + list(prompt_ids)
        return ids, (features, grid)


def _tokenizer(root: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(root))
    except (OSError, ValueError) as e:
        raise UserError(f"{root}: cannot load the bundle's tokenizer: {e}") from None


def _load_vision(root: Path, arch, config: dict, dtype):
    from qbuild.model.runtime.images import VisionRuntime

    return VisionRuntime.load(root, arch, config, dtype)


def _load_graph(path: Path, file_format: str):
    """A callable (weights, *args) -> outputs of a compiled graph file: an AOTInductor package or an exported
    program."""
    import torch

    if file_format == "aoti-package":
        return torch._inductor.aoti_load_package(str(path))
    if file_format == "exported-program":
        from qbuild.model.runtime import exported

        return exported.load(str(path)).module()
    raise UserError(f"{path}: unknown graph format {file_format!r}")
