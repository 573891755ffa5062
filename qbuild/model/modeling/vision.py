"""The VL side of the reference model: the vision encoder and the host-side glue to the text decoder.

Split as the Neuron port splits it (docs/nxd-layout.md section 6):
- host (`VisionHost`, plain tensors in and out): patch embedding (Conv3d), bilinear interpolation of the learned
  position grid, the 2-D rotary tables and the block-diagonal attention mask (-65504, not -inf), padded to a
  static bucket of patch tokens;
- traced (`VisionEncoder.forward(hidden (S, hidden), mask (1, 1, S, S), cos (S, hd), sin (S, hd))`): the blocks and
  the 2x2 patch merger, giving (S/4, out_hidden) merged features;
- text glue: `embed_with_images` puts the merged features at the image-token positions, and
  `mrope_position_ids` / `decode_position_ids` give the 3-D mRoPE positions (HF's get_rope_index);
- tiles: `split_tiles` / `stitch_tiles` cut an image too large for every bucket into 2x2 tiles and put their merged
  features back in the image's order, as the VL ports do (qbuild.model.tiling says when; docs/vision.md section 2).

Patch tokens are in spatial-merge-block order (each run of merge**2 consecutive tokens is one merged token), as
the HF image processor emits them. Legend: N patch tokens, S bucket (N <= S, S a multiple of merge**2), hd head dim.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from qbuild.model.arch import Arch, VisionArch

MASK_VALUE = -65504.0  # the most negative float16: finite, so a fully masked row cannot produce NaN on device
LAYERNORM_EPS = 1e-6


def _strict_load(module: nn.Module, tensors: Mapping[str, torch.Tensor], what: str) -> None:
    expected = module.state_dict()
    missing, unexpected = sorted(expected.keys() - tensors.keys()), sorted(tensors.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(f"{what}: missing tensors {missing}, unexpected tensors {unexpected}")
    for name, target in expected.items():
        if tensors[name].shape != target.shape:
            raise ValueError(f"{what}: tensor {name} has shape {tuple(tensors[name].shape)}, "
                             f"expected {tuple(target.shape)}")
    module.load_state_dict(dict(tensors), strict=True)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _block_order(x_HW: torch.Tensor, merge: int) -> torch.Tensor:
    """(h, w, ...) raster grid -> (h*w, ...) in spatial-merge-block order."""
    h, w = x_HW.shape[:2]
    blocks = x_HW.reshape(h // merge, merge, w // merge, merge, *x_HW.shape[2:])
    return blocks.transpose(1, 2).reshape(h * w, *x_HW.shape[2:])


def _bilinear_taps(size: int, side: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """align_corners bilinear resampling of `side` grid points to `size`: (lower index, upper index, upper weight)."""
    src = torch.arange(size, dtype=torch.float32) * (side - 1) / max(size - 1, 1)
    lower = src.floor()
    frac = src - lower
    lower = lower.long().clamp(0, side - 1)
    return lower, (lower + 1).clamp(max=side - 1), frac


class VisionHost(nn.Module):
    """The host-side inputs of the traced encoder. Weights: `patch_embed.proj.{weight,bias}`, `pos_embed.weight`.

    Built from the whole Arch: besides the encoder it needs the vision rotary base, a host-side fact."""

    def __init__(self, arch: Arch, dtype: torch.dtype = torch.float32):
        super().__init__()
        vision = self.vision = arch.vision
        self.rope_theta = arch.vision_rope_theta
        kernel = (vision.temporal_patch_size, vision.patch_size, vision.patch_size)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(vision.in_channels, vision.hidden_size, kernel, stride=kernel, bias=True,
                                          dtype=dtype)
        self.pos_embed = nn.Embedding(vision.num_position_embeddings, vision.hidden_size, dtype=dtype)
        self.side = int(vision.num_position_embeddings**0.5)
        self.requires_grad_(False)

    def patch_tokens(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(N, C*T*P*P) flattened patches, as the HF processor gives them -> (N, hidden)."""
        c = self.vision
        patches = pixel_values.reshape(-1, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        weight = self.patch_embed.proj.weight
        return self.patch_embed.proj(patches.to(weight.dtype)).reshape(-1, c.hidden_size)

    def position_embeddings(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """The learned side x side grid bilinearly resampled to each image's (h, w) grid, block order -> (N, hidden)."""
        table = self.pos_embed.weight
        out = []
        for t, h, w in grid_thw.tolist():
            h_lo, h_hi, h_frac = _bilinear_taps(h, self.side)
            w_lo, w_hi, w_frac = _bilinear_taps(w, self.side)
            emb = 0
            for rows, row_w in ((h_lo, 1 - h_frac), (h_hi, h_frac)):
                for cols, col_w in ((w_lo, 1 - w_frac), (w_hi, w_frac)):
                    weight_HW = row_w[:, None] * col_w[None, :]
                    emb = emb + table[rows[:, None] * self.side + cols[None, :]] * weight_HW[..., None].to(table.dtype)
            out.append(_block_order(emb, self.vision.spatial_merge_size).repeat(t, 1))
        return torch.cat(out)

    def rotary(self, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """2-D rotary tables (N, hd): the first half of the frequencies follow the row, the second the column."""
        dim = self.vision.head_dim // 2
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        freqs = []
        for t, h, w in grid_thw.tolist():
            rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            pos_HW2 = torch.stack([rows, cols], dim=-1)
            pos = _block_order(pos_HW2, self.vision.spatial_merge_size).repeat(t, 1).float()  # (h*w*t, 2)
            freqs.append((pos[:, :, None] * inv_freq).flatten(1))  # [h freqs | w freqs]
        emb = torch.cat(freqs).repeat(1, 2)
        return emb.cos(), emb.sin()

    @staticmethod
    def attention_mask(grid_thw: torch.Tensor, bucket: int) -> torch.Tensor:
        """(1, 1, S, S) additive mask: 0 inside each frame's block (and inside the padding block), -65504 elsewhere."""
        frames = [h * w for t, h, w in grid_thw.tolist() for _ in range(t)]
        pad = bucket - sum(frames)
        segment = torch.repeat_interleave(torch.arange(len(frames) + 1), torch.tensor(frames + [pad]))
        same = segment[:, None] == segment[None, :]
        return torch.where(same, 0.0, MASK_VALUE)[None, None]

    @torch.no_grad()
    def prepare(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, bucket: int):
        """Everything the traced encoder takes, padded to `bucket` patch tokens.

        Returns (hidden (S, hidden), mask (1, 1, S, S), cos (S, hd), sin (S, hd), number of merged tokens to keep).
        """
        unit = self.vision.spatial_merge_size**2
        hidden = self.patch_tokens(pixel_values) + self.position_embeddings(grid_thw)
        cos, sin = self.rotary(grid_thw)
        num = hidden.shape[0]
        if num > bucket or bucket % unit:
            raise ValueError(f"{num} patch tokens do not fit bucket {bucket} (a multiple of {unit} >= the tokens)")
        pad = bucket - num
        hidden = F.pad(hidden, (0, 0, 0, pad))
        cos, sin = F.pad(cos, (0, 0, 0, pad), value=1.0), F.pad(sin, (0, 0, 0, pad))
        return hidden, self.attention_mask(grid_thw, bucket).to(hidden.dtype), cos, sin, num // unit


class ShardedLinear(nn.Linear):
    """nn.Linear computed as NxD's parallel layers compute it over `tp` ranks, from the whole weight (the CPU graph
    takes the unsharded weights and cuts them itself). "column" = ColumnParallelLinear(gather_output=True): each rank
    makes its block of outputs, gathered in rank order (the same dot products as the whole layer); "row" =
    RowParallelLinear(input_is_parallel=False): each rank multiplies its slice of the input by its columns of the
    weight, the partial sums are added in rank order (the all-reduce), then the bias once. tp 1: nn.Linear.
    The port's TP encoder (NeuronQwen35VisionModel, modeling_qwen35_vision.py:120-208 @ 4bcdc54) is column qkv and fc1,
    row proj and fc2 (docs/vision.md section 3)."""

    def __init__(self, fan_in: int, fan_out: int, dtype: torch.dtype, split: str, tp: int):
        super().__init__(fan_in, fan_out, dtype=dtype)
        self.split, self.tp = split, tp

    def forward(self, x):
        if self.tp == 1:
            return super().forward(x)
        if self.split == "column":
            return torch.cat([F.linear(x, w, b) for w, b in zip(self.weight.chunk(self.tp), self.bias.chunk(self.tp))],
                             dim=-1)
        partials = [F.linear(xr, wr) for xr, wr in zip(x.chunk(self.tp, dim=-1), self.weight.chunk(self.tp, dim=1))]
        total = partials[0]
        for part in partials[1:]:
            total = total + part
        return total + self.bias


class VisionAttention(nn.Module):
    def __init__(self, vision: VisionArch, dtype: torch.dtype, tp: int = 1):
        super().__init__()
        self.heads, self.head_dim = vision.num_heads, vision.head_dim
        self.qkv = ShardedLinear(vision.hidden_size, 3 * vision.hidden_size, dtype, "column", tp)
        self.proj = ShardedLinear(vision.hidden_size, vision.hidden_size, dtype, "row", tp)

    def forward(self, x_SD, mask, cos, sin):
        length = x_SD.shape[0]
        q, k, v = self.qkv(x_SD).reshape(length, 3, self.heads, self.head_dim).unbind(1)  # (S, heads, hd)
        cos, sin = cos[:, None].float(), sin[:, None].float()
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(v.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(v.dtype)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # (heads, S, hd)
        scores = (q @ k.transpose(-1, -2)).float() * self.head_dim**-0.5 + mask[0].float()
        out = scores.softmax(-1).to(v.dtype) @ v
        return self.proj(out.transpose(0, 1).reshape(length, -1))


class VisionMLP(nn.Module):
    def __init__(self, vision: VisionArch, dtype: torch.dtype, tp: int = 1):
        super().__init__()
        self.linear_fc1 = ShardedLinear(vision.hidden_size, vision.intermediate_size, dtype, "column", tp)
        self.linear_fc2 = ShardedLinear(vision.intermediate_size, vision.hidden_size, dtype, "row", tp)

    def forward(self, x):
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, vision: VisionArch, dtype: torch.dtype, tp: int = 1):
        super().__init__()
        self.norm1 = nn.LayerNorm(vision.hidden_size, eps=LAYERNORM_EPS, dtype=dtype)
        self.norm2 = nn.LayerNorm(vision.hidden_size, eps=LAYERNORM_EPS, dtype=dtype)
        self.attn = VisionAttention(vision, dtype, tp)
        self.mlp = VisionMLP(vision, dtype, tp)

    def forward(self, x, mask, cos, sin):
        x = x + self.attn(self.norm1(x), mask, cos, sin)
        return x + self.mlp(self.norm2(x))


class VisionEncoder(nn.Module):
    """The traced part: blocks, then LayerNorm, 2x2 merge (merge**2 consecutive tokens), fc1, exact GELU, fc2.
    With `tp` > 1 the blocks' linear layers compute as the port's TP-sharded encoder does (ShardedLinear); the
    merger is whole on every rank there too. Its weights are the same whole tensors at any tp."""

    def __init__(self, vision: VisionArch, dtype: torch.dtype = torch.float32, tp: int = 1):
        super().__init__()
        if problem := vision.tp_problem(tp):
            raise ValueError(problem)
        self.vision = vision
        self.blocks = nn.ModuleList(VisionBlock(vision, dtype, tp) for _ in range(vision.depth))
        self.merger_norm = nn.LayerNorm(vision.hidden_size, eps=LAYERNORM_EPS, dtype=dtype)
        self.merger_fc1 = nn.Linear(vision.merged_hidden_size, vision.merged_hidden_size, dtype=dtype)
        self.merger_fc2 = nn.Linear(vision.merged_hidden_size, vision.out_hidden_size, dtype=dtype)
        self.requires_grad_(False)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """hidden (S, hidden), mask (1, 1, S, S), cos / sin (S, hd) -> merged features (S / merge**2, out_hidden)."""
        for block in self.blocks:
            hidden = block(hidden, mask, cos, sin)
        merged = self.merger_norm(hidden).reshape(-1, self.vision.merged_hidden_size)
        return self.merger_fc2(F.gelu(self.merger_fc1(merged)))


def load_vision(arch: Arch, tensors: Mapping[str, torch.Tensor],
                dtype: torch.dtype = torch.float32) -> tuple[VisionHost, VisionEncoder]:
    """Build the host side and the traced encoder from the converted vision tensors, strictly."""
    host, encoder = VisionHost(arch, dtype), VisionEncoder(arch.vision, dtype)
    host_names = set(host.state_dict())
    _strict_load(host, {n: t for n, t in tensors.items() if n in host_names}, "vision host weights")
    _strict_load(encoder, {n: t for n, t in tensors.items() if n not in host_names}, "vision encoder weights")
    return host, encoder


def encode_images(host: VisionHost, encoder: VisionEncoder, pixel_values: torch.Tensor, grid_thw: torch.Tensor,
                  bucket: int) -> torch.Tensor:
    """Host preparation, the encoder on one bucket, and the padding dropped -> (merged tokens, out_hidden)."""
    hidden, mask, cos, sin, keep = host.prepare(pixel_values, grid_thw, bucket)
    with torch.no_grad():
        return encoder(hidden, mask, cos, sin)[:keep]


def split_tiles(pixel_values: torch.Tensor, grid: tuple[int, int, int]) -> list[torch.Tensor]:
    """The 2x2 tiles of one still image's patches (N, D), each (N / 4, D) with patch grid tiling.tile_grid(grid),
    ordered top-left, top-right, bottom-left, bottom-right, cut as the ports cut them
    (NeuronQwen35VisionModelWrapper._tiled_forward, modeling_qwen35_vision.py:922-930 @ 4bcdc54): the rows of patches
    are read as an (h, w) raster and each quadrant of it is a tile. The processor's rows are in spatial-merge-block
    order, not raster order, so a tile is not the image's quadrant (docs/vision.md section 2); this is what the
    port's encoder sees, and what a CPU bundle reproduces."""
    _, h, w = grid
    raster = pixel_values.reshape(h, w, -1)
    th, tw = h // 2, w // 2
    return [raster[r:r + th, c:c + tw].reshape(th * tw, -1) for r in (0, th) for c in (0, tw)]


def stitch_tiles(features: list[torch.Tensor], grid: tuple[int, int, int], merge: int) -> torch.Tensor:
    """The merged features of the four tiles, each (h/2/merge * w/2/merge, out) in its own row-major order, placed at
    their quadrant of the image's (h/merge, w/merge) merged grid and read back row by row -> (h*w/merge**2, out), the
    order of the image's tokens in the prompt (modeling_qwen35_vision.py:943-961 @ 4bcdc54)."""
    _, h, w = grid
    mh, mw = h // merge, w // merge
    th, tw = mh // 2, mw // 2
    out = features[0].new_zeros(mh, mw, features[0].shape[-1])
    for tile, (r, c) in zip(features, ((0, 0), (0, tw), (th, 0), (th, tw))):
        out[r:r + th, c:c + tw] = tile.reshape(th, tw, -1)
    return out.reshape(mh * mw, -1)


def embed_with_images(embed_tokens: torch.Tensor, input_ids: torch.Tensor, image_features: torch.Tensor,
                      image_token_id: int) -> torch.Tensor:
    """Token embeddings (B, S, H) with the image-token positions replaced, in order, by `image_features` (M, H)."""
    embeds = F.embedding(input_ids, embed_tokens)
    is_image = input_ids == image_token_id
    if int(is_image.sum()) != image_features.shape[0]:
        raise ValueError(f"{int(is_image.sum())} image tokens but {image_features.shape[0]} image features")
    embeds[is_image] = image_features.to(embeds.dtype)
    return embeds


def mrope_position_ids(input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None, arch: Arch,
                       seq_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """3-D mRoPE positions of a (right-padded) prompt batch, as HF's get_rope_index computes them.

    Text advances all three axes together; a run of image tokens of grid (t, h, w) takes positions
    start + (t index, row, column) on the merged grid, and the text after it resumes at start + max(h, w) / merge.
    Images are taken from `image_grid_thw` in order, row by row.
    Returns position ids (3, B, S) and rope deltas (B,) (decode position = cache slot + delta).
    """
    batch, length = input_ids.shape
    seq_lens = torch.full((batch,), length) if seq_lens is None else seq_lens
    grids = iter(image_grid_thw.tolist() if image_grid_thw is not None else [])
    position_ids = torch.zeros(3, batch, length, dtype=torch.long)
    deltas = torch.zeros(batch, dtype=torch.long)
    for b in range(batch):
        n = int(seq_lens[b])
        # A text-only row (or a text-only export of a VL family, which has mRoPE but no image token) counts its
        # positions on all three axes together, padding included: the loop below would give the same, token by token.
        marked = None if arch.image_token_id is None else input_ids[b, :n] == arch.image_token_id
        if marked is None or not bool(marked.any()):
            position_ids[:, b] = torch.arange(length)
            continue
        is_image = marked.tolist()
        pieces, start, i = [], 0, 0
        while i < n:
            j = i
            while j < n and is_image[j] == is_image[i]:
                j += 1
            if not is_image[i]:
                pieces.append(torch.arange(j - i).expand(3, -1) + start)
                start += j - i
            else:
                t, h, w = next(grids)
                merge = arch.vision.spatial_merge_size
                h, w = h // merge, w // merge
                if t * h * w != j - i:
                    raise ValueError(f"row {b}: a run of {j - i} image tokens does not match image grid "
                                     f"{(t, h * merge, w * merge)}")
                grid = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
                pieces.append(torch.stack(grid).reshape(3, -1) + start)
                start += max(h, w)
            i = j
        real = torch.cat(pieces, dim=1)
        position_ids[:, b, :n] = real
        position_ids[:, b, n:] = torch.arange(length - n) + start  # padding: any value works; keep counting
        deltas[b] = real.max() + 1 - n
    return position_ids, deltas


def decode_position_ids(positions: torch.Tensor, rope_deltas: torch.Tensor) -> torch.Tensor:
    """mRoPE positions (3, B, 1) of the tokens at cache slots `positions` (B,), after a prompt with these deltas."""
    return (positions + rope_deltas)[None, :, None].expand(3, -1, -1).contiguous()


def vision_example_inputs(vision: VisionArch, bucket: int, dtype: torch.dtype = torch.float32):
    """Inputs of the traced encoder's shapes and dtypes for one bucket (values irrelevant): for tracing."""
    if bucket % vision.spatial_merge_size**2:
        raise ValueError(f"vision bucket {bucket} must be a multiple of {vision.spatial_merge_size**2}")
    return (torch.zeros(bucket, vision.hidden_size, dtype=dtype), torch.zeros(1, 1, bucket, bucket, dtype=dtype),
            torch.ones(bucket, vision.head_dim), torch.zeros(bucket, vision.head_dim))
