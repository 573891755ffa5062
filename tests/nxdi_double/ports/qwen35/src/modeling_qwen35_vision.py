"""Fake of the main-lineage port's src/modeling_qwen35_vision.py (Qwen3.5-35B-A3B @ 4bcdc54): CPUVisionModel, the module
compile_vision_encoder.py traces with the real weights (docs/nxdi.md section 5); NeuronQwen35VisionModel, the TP-sharded
encoder compile_vision_encoder_tp.py traces (docs/vision.md section 3); and NeuronQwen35VisionModelWrapper: its loading
of the compiled buckets and of the host-side embeddings, its choice of bucket and 2x2 tiles for an image, and its
forward, which runs the loaded buckets with the inputs of each bucket's shape (docs/vision.md sections 2 and 8).

The 35B-A3B copy loads single-core buckets only; the 2B copy also loads TP-sharded ones (`bucket_<N>/tp_*.pt`, through
its module-level _TPVisionAdapter): tests.nxdi_double.vision_tp_port() writes that copy (TP_VISION_BUCKETS = True).

`CPUVisionModel(config)` takes the vision config only (no weights) and has exactly the parameter names the port's
load_cpu_model fills: blocks.{i}.{norm1,norm2,attn.qkv,attn.proj,mlp.linear_fc1,mlp.linear_fc2}.{weight,bias},
merger_norm, merger_fc1, merger_fc2; the patch and position embeddings run on the host and are not part of it.
`forward(hidden_states, attention_mask, cos, sin)` with hidden (S, hidden), mask (1, 1, S, S), cos/sin (S, head_dim).
The shapes are those of the HF vision encoder the port loads from (LayerNorms with bias, qkv fused, the 2x2 merger);
the arithmetic is a plain ViT block, enough for torch.jit.trace, not a numerical copy of the port.
"""

from __future__ import annotations

import glob
import os

import torch
from torch import nn

from neuronx_distributed_inference._double import record

# The 2B port's wrapper loads TP-sharded buckets (modeling_qwen35_vision.py:75-92, 455-485 @ 4bcdc54); the 35B-A3B
# port's does not (L409-473).
TP_VISION_BUCKETS = False


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x, mask, cos, sin):
        s, hidden = x.shape
        q, k, v = self.qkv(x).reshape(s, 3, self.heads, hidden // self.heads).permute(1, 2, 0, 3)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        scores = q @ k.transpose(-1, -2) / (hidden // self.heads) ** 0.5 + mask[0]
        out = torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v
        return self.proj(out.transpose(0, 1).reshape(s, hidden))


class _MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden, intermediate)
        self.linear_fc2 = nn.Linear(intermediate, hidden)

    def forward(self, x):
        return self.linear_fc2(nn.functional.gelu(self.linear_fc1(x), approximate="tanh"))


class _Block(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int, attention: type = None, mlp: type = None):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, eps=1e-6)
        self.norm2 = nn.LayerNorm(hidden, eps=1e-6)
        self.attn = (attention or _Attention)(hidden, heads)
        self.mlp = (mlp or _MLP)(hidden, intermediate)

    def forward(self, x, mask, cos, sin):
        x = x + self.attn(self.norm1(x), mask, cos, sin)
        return x + self.mlp(self.norm2(x))


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class CPUVisionModel(nn.Module):
    _layers: tuple = (None, None)   # the blocks' attention and MLP classes (None: the plain ones)

    def __init__(self, config):
        super().__init__()
        hidden, merge = config.hidden_size, config.spatial_merge_size
        self.merged = hidden * merge * merge
        self.blocks = nn.ModuleList(_Block(hidden, config.num_heads, config.intermediate_size, *self._layers)
                                    for _ in range(config.depth))
        self.merger_norm = nn.LayerNorm(hidden, eps=1e-6)
        self.merger_fc1 = nn.Linear(self.merged, self.merged)
        self.merger_fc2 = nn.Linear(self.merged, config.out_hidden_size)

    def forward(self, hidden_states, attention_mask, cos, sin):
        x = hidden_states
        for block in self.blocks:
            x = block(x, attention_mask, cos, sin)
        x = self.merger_norm(x).reshape(-1, self.merged)
        return self.merger_fc2(nn.functional.gelu(self.merger_fc1(x)))


# --- the TP-sharded encoder (NeuronQwen35VisionModel, L120-276 @ 4bcdc54) ---------------------------------------------

class _TPAttention(_Attention):
    def __init__(self, hidden: int, heads: int):
        from neuronx_distributed.parallel_layers import layers as nxd_layers

        nn.Module.__init__(self)
        self.heads = heads
        self.qkv = nxd_layers.ColumnParallelLinear(hidden, 3 * hidden, bias=True, gather_output=True)
        self.proj = nxd_layers.RowParallelLinear(hidden, hidden, bias=True, input_is_parallel=False)


class _TPMLP(_MLP):
    def __init__(self, hidden: int, intermediate: int):
        from neuronx_distributed.parallel_layers import layers as nxd_layers

        nn.Module.__init__(self)
        self.linear_fc1 = nxd_layers.ColumnParallelLinear(hidden, intermediate, bias=True, gather_output=True)
        self.linear_fc2 = nxd_layers.RowParallelLinear(intermediate, hidden, bias=True, input_is_parallel=False)


class NeuronQwen35VisionModel(CPUVisionModel):
    """CPUVisionModel's parameters, its blocks' linear layers NxD's parallel ones; forward(hidden_states,
    attention_mask, position_embeddings=(cos, sin)): the RoPE pair is ONE input."""

    _layers = (_TPAttention, _TPMLP)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None):
        return super().forward(hidden_states, attention_mask, *position_embeddings)


if TP_VISION_BUCKETS:
    class _TPVisionAdapter:
        """L75-92: a parallel_model_load()ed bucket called with (hidden, mask, cos, sin), the pair re-packed."""

        def __init__(self, parallel_model):
            self._m = parallel_model

        def __call__(self, hidden_states, attention_mask, cos, sin):
            out = self._m(hidden_states, attention_mask, (cos, sin))
            return out[0] if isinstance(out, (list, tuple)) else out


# --- the wrapper: which compiled buckets it loads, which an image takes, and how it runs them --------------------------

# The finite "minus infinity" the port pads its vision attention mask with (modeling_qwen35_vision.py:26 @ 4bcdc54).
MASK_NEG_INF = -65504.0
# The HF tensors load_vision_weights_from_hf copies, and where (L531-555).
HOST_KEYS = ("model.visual.patch_embed.proj.weight", "model.visual.patch_embed.proj.bias",
             "model.visual.pos_embed.weight")


class _PatchEmbed(nn.Module):
    """The host-side patch embedding (the port builds transformers' Qwen3.5 vision patch embed, L414-418): a Conv3d of
    kernel = stride = (temporal_patch_size, patch_size, patch_size) over each patch row of pixel_values."""

    def __init__(self, config):
        super().__init__()
        self.shape = (getattr(config, "in_channels", 3), config.temporal_patch_size, config.patch_size,
                      config.patch_size)
        self.proj = nn.Conv3d(self.shape[0], config.hidden_size, self.shape[1:], stride=self.shape[1:], bias=True)

    def forward(self, pixel_values):
        return self.proj(pixel_values.view(-1, *self.shape).to(self.proj.weight.dtype)).view(pixel_values.shape[0], -1)


class NeuronQwen35VisionModelWrapper(nn.Module):
    """The standalone wrapper (model_cls=None) the VL scripts build, an nn.Module (L386, L402-427).

    - `load_compiled(dir)` (L429-529 in the 2B copy): with TP_VISION_BUCKETS, every `bucket_<N>/` holding `tp_*.pt` is
      loaded with NxD's parallel_model_load as bucket N, then every `vision_encoder_<N>.pt` with torch.jit.load, a TP
      bucket taking priority over a single-core one of the same size; the loaded sizes become vision_seq_len_buckets.
    - `load_vision_weights_from_hf(dir)` (L531-555): every *.safetensors of `dir`, the three HOST_KEYS copied into the
      patch and position embeddings, any other key ignored, nothing said where none is found.
    - `forward(pixel_values, image_grid_thw)` (L771-900): an image whose patches exceed the largest bucket and that the
      port can tile runs as 2x2 tiles (_tiled_forward, L902-961); otherwise the host embeddings run, the inputs are
      padded to the smallest bucket that holds them (L826-839) and that bucket's compiled encoder is called with
      (hidden (B, hidden), mask (1, 1, B, B), cos (B, head_dim), sin (B, head_dim)) in bfloat16 (L841-854); the output
      is cut to the image's merged tokens (L890-898). The double is stricter: it runs no CPU encoder (none is loaded
      by qbuild), refuses an image the compiled buckets cannot take, and refuses to run embeddings that were never
      loaded (the port would run them as initialised). Its position embedding takes rows by patch index and its
      rotary angles are a plain function of the patch index, not the port's interpolation: the shapes are the port's,
      the values only the double's.
    - `route(grid_thw)` is the double's own: what forward does with an image of that patch grid, without running it.
    """

    def __init__(self, config, model_cls=None, **kwargs):
        super().__init__()
        self.vision_config = config
        self._compiled_buckets = None
        self.tp_buckets: dict[int, int] = {}   # the double's record: bucket -> ranks loaded
        self.host_loaded: list[str] = []        # the double's record: the HF keys load_vision_weights_from_hf found
        self.vision_seq_len_buckets = kwargs.get("vision_seq_len_buckets", [1024, 4096, 16384])
        self.patch_embed = _PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)

    def load_compiled(self, compiled_model_path):
        if not os.path.isdir(compiled_model_path):
            raise FileNotFoundError(f"Vision encoder path not found: {compiled_model_path}")
        tp = {}
        if TP_VISION_BUCKETS:
            from neuronx_distributed.trace import parallel_model_load

            for entry in sorted(os.listdir(compiled_model_path)):
                sub = os.path.join(compiled_model_path, entry)
                if not entry.startswith("bucket_") or not os.path.isdir(sub):
                    continue
                try:
                    size = int(entry.replace("bucket_", ""))
                except ValueError:
                    continue
                if glob.glob(os.path.join(sub, "tp_*.pt")):
                    tp[size] = _TPVisionAdapter(parallel_model_load(sub))
                    self.tp_buckets[size] = len(glob.glob(os.path.join(sub, "tp_*.pt")))
        files = sorted(glob.glob(os.path.join(compiled_model_path, "vision_encoder_*.pt")))
        if not tp and not files:
            raise FileNotFoundError(f"No vision encoder files found in {compiled_model_path}")
        self._compiled_buckets = {}
        for path in files:
            size = int(os.path.basename(path).replace("vision_encoder_", "").replace(".pt", ""))
            self._compiled_buckets[size] = torch.jit.load(path)
        self._compiled_buckets.update(tp)
        self.vision_seq_len_buckets = sorted(self._compiled_buckets)
        record("vision_load_compiled", path=str(compiled_model_path), buckets=self.vision_seq_len_buckets,
               tp=self.tp_buckets)

    def load_vision_weights_from_hf(self, model_path):
        from pathlib import Path

        from safetensors import safe_open

        targets = {HOST_KEYS[0]: self.patch_embed.proj.weight, HOST_KEYS[1]: self.patch_embed.proj.bias,
                   HOST_KEYS[2]: self.pos_embed.weight}
        for path in sorted(Path(model_path).glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    if key in targets:
                        targets[key].data.copy_(f.get_tensor(key))
                        self.host_loaded.append(key)
        record("vision_load_host_weights", path=str(model_path), loaded=sorted(self.host_loaded))

    def forward(self, pixel_values, image_grid_thw):
        if self._compiled_buckets is None:
            raise RuntimeError("the vision wrapper runs before load_compiled(): no compiled bucket is loaded")
        missing = sorted(set(HOST_KEYS) - set(self.host_loaded))
        if missing:
            raise RuntimeError(f"the patch and position embeddings were never loaded ({missing[0]}: "
                               "load_vision_weights_from_hf found no such key); the port would run them as "
                               "initialised")
        grid = [list(map(int, row)) for row in image_grid_thw.tolist()]
        c = self.patch_embed.shape
        patches = sum(t * h * w for t, h, w in grid)
        if tuple(pixel_values.shape) != (patches, c[0] * c[1] * c[2] * c[3]):
            raise ValueError(f"pixel_values {list(pixel_values.shape)} for a grid of {grid}: expected "
                             f"[{patches}, {c[0] * c[1] * c[2] * c[3]}]")
        route = self.route(grid)
        if route[0] == "tiled":
            return self._tiled_forward(pixel_values, image_grid_thw)
        if route[0] != "bucket":
            raise RuntimeError(f"an image of grid {grid} fits no compiled bucket {self.vision_seq_len_buckets} "
                               f"({route}); the port would {'assert' if route[0] == 'assert' else 'need a CPU encoder'}")
        return self._encode(pixel_values, grid, route[1])

    def _encode(self, pixel_values, grid, bucket):
        n = pixel_values.shape[0]
        hidden = self.patch_embed(pixel_values) + self.pos_embed.weight[torch.arange(n) % self.pos_embed.num_embeddings]
        head_dim = self.vision_config.hidden_size // self.vision_config.num_heads
        angles = torch.arange(n, dtype=torch.float32)[:, None] / 10000 ** (
            torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        emb = torch.cat([angles, angles], dim=-1)
        mask = torch.full((1, 1, bucket, bucket), MASK_NEG_INF)
        mask[:, :, :n, :n] = 0.0
        pad = (0, 0, 0, bucket - n)
        args = [nn.functional.pad(hidden, pad), mask, nn.functional.pad(emb.cos(), pad),
                nn.functional.pad(emb.sin(), pad)]
        args = [a.to(torch.bfloat16) for a in args]
        record("vision_encode", bucket=bucket, grid=grid, patches=n, tp=self.tp_buckets.get(bucket, 1),
               inputs=[{"shape": list(a.shape), "dtype": str(a.dtype).split(".")[1]} for a in args])
        with torch.no_grad():
            out = self._compiled_buckets[bucket](*args)
        merge = self.vision_config.spatial_merge_size
        return out[:sum(t * (h // merge) * (w // merge) for t, h, w in grid)]

    def _tiled_forward(self, pixel_values, image_grid_thw):
        """L902-961: the (H*W, patch_dim) rows read as an (H, W) raster, its quadrants (0, 0), (0, W/2), (H/2, 0),
        (H/2, W/2) encoded each with the grid (1, H/2, W/2) through forward, their merged outputs put back into the
        quadrants of the (H/m, W/m) merged grid, read row by row."""
        t, h, w = (int(x) for x in image_grid_thw[0])
        merge = self.vision_config.spatial_merge_size
        assert t == 1 and h % (2 * merge) == 0 and w % (2 * merge) == 0, f"H={h}, W={w}"
        ht, wt = h // 2, w // 2
        raster = pixel_values.reshape(h, w, pixel_values.shape[1])
        tile_grid = torch.tensor([[1, ht, wt]], dtype=image_grid_thw.dtype)
        tiles = [self.forward(raster[r:r + ht, c:c + wt].reshape(ht * wt, -1), tile_grid)
                 for r in (0, ht) for c in (0, wt)]
        mh, mw, mht, mwt = h // merge, w // merge, ht // merge, wt // merge
        full = torch.zeros((mh, mw, tiles[0].shape[-1]), dtype=tiles[0].dtype)
        for tile, (r, c) in zip(tiles, [(0, 0), (0, mwt), (mht, 0), (mht, mwt)]):
            full[r:r + mht, c:c + mwt] = tile.reshape(mht, mwt, -1)
        return full.reshape(mh * mw, -1)

    def route(self, grid_thw) -> tuple:
        """("bucket", b): the image runs whole through bucket b; ("tiled", b): as 2x2 tiles, each through bucket b;
        ("assert", why): _tiled_forward's assertion fails; ("cpu-fallback",): larger than every bucket and not tiled
        (the CPU encoder runs it where one is loaded)."""
        gthw = [list(map(int, row)) for row in grid_thw]
        n = sum(t * h * w for t, h, w in gthw)
        largest = max(self._compiled_buckets)
        can_tile = n > largest and len(gthw) == 1 and gthw[0][1] % 2 == 0 and gthw[0][2] % 2 == 0 and \
            n // 4 <= largest                                                       # L793-800
        if can_tile:
            t, h, w = gthw[0]
            merge = self.vision_config.spatial_merge_size
            if t != 1 or h % (2 * merge) or w % (2 * merge):                       # L913-919
                return ("assert", f"t={t}, H={h}, W={w}")
            return ("tiled", self._bucket(n // 4))
        bucket = self._bucket(n)
        return ("bucket", bucket) if n <= bucket else ("cpu-fallback",)             # L826-867

    def _bucket(self, n: int) -> int:
        """_get_vision_bucket (L624-629): the smallest bucket that holds n, else the largest."""
        for bucket in sorted(self.vision_seq_len_buckets):
            if n <= bucket:
                return bucket
        return self.vision_seq_len_buckets[-1]
