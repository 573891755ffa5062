"""The gated delta rule (Gated DeltaNet's token mixer) in three interchangeable torch forms.

All forms take the same arguments in the same order and return ``(out, final_state)``:

    q, k          (B, T, Hk, dk)   queries / keys, already L2-normalised by the caller
    v             (B, T, Hv, dv)   values; Hv is a multiple of Hk (grouped value heads)
    g             (B, T, Hv)       log-decay per step, <= 0 (the state is multiplied by exp(g_t))
    beta          (B, T, Hv)       write strength in [0, 1]
    initial_state (B, Hv, dk, dv)  float32 state, or None for zeros
    out           (B, T, Hv, dv)   in v's dtype
    final_state   (B, Hv, dk, dv)  float32

Per value head, with the state S of shape (dk, dv):
    S <- S * exp(g_t);  delta = (v_t - S^T k_t) * beta_t;  S <- S + k_t (x) delta;  o_t = S^T (q_t * scale)
Key head j serves value heads j*r .. j*r+r-1 (r = Hv / Hk), as HF's repeat_interleave does.
A step with beta = 0 and g = 0 leaves the state untouched: that is how right-padding is masked.

- `naive_recurrent`: the formula above, one step at a time; computes in float64 when given float64 inputs,
  so it doubles as a high-precision oracle for the other forms.
- `chunk_gated_delta_rule`: the chunked (prefill) form, static-shaped and matmul-only (exportable).
- `recurrent_gated_delta_rule`: the decode form, one fused step per token (T is 1 when decoding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64


def _expand_key_heads(x: torch.Tensor, num_value_heads: int) -> torch.Tensor:
    """(B, T, Hk, d) -> (B, T, Hv, d): each key head serves Hv/Hk consecutive value heads."""
    num_key_heads = x.shape[2]
    if num_value_heads % num_key_heads:
        raise ValueError(f"value heads ({num_value_heads}) must be a multiple of key heads ({num_key_heads})")
    return x.repeat_interleave(num_value_heads // num_key_heads, dim=2)


def _prepare(q, k, v, g, beta, initial_state, scale, dtype):
    """Common prologue: expand key heads, move heads before time ((B, H, T, d)), cast, scale q, make a state."""
    batch, _, num_v_heads, dv = v.shape
    dk = q.shape[-1]
    scale = dk**-0.5 if scale is None else scale
    q, k = _expand_key_heads(q, num_v_heads), _expand_key_heads(k, num_v_heads)
    q, k, v = (x.transpose(1, 2).to(dtype) for x in (q, k, v))
    g, beta = (x.transpose(1, 2).to(dtype) for x in (g, beta))
    if initial_state is None:
        state = torch.zeros(batch, num_v_heads, dk, dv, dtype=dtype, device=v.device)
    else:
        state = initial_state.to(dtype)
    return q * scale, k, v, g, beta, state


def _finish(out_BHTV: torch.Tensor, state: torch.Tensor, out_dtype: torch.dtype, state_dtype: torch.dtype):
    """(B, H, T, dv) -> (B, T, H, dv) in the caller's dtype; the state in `state_dtype`."""
    return out_BHTV.transpose(1, 2).to(out_dtype).contiguous(), state.to(state_dtype)


def naive_recurrent(q, k, v, g, beta, initial_state=None, *, scale: float | None = None):
    """The gated delta rule exactly as written, one token at a time (see the module docstring for shapes).

    Computes in float32, or float64 if `v` is float64; the final state comes back in that precision.
    """
    dtype, out_dtype = torch.promote_types(v.dtype, torch.float32), v.dtype
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, initial_state, scale, dtype)
    outs = []
    for t in range(v.shape[2]):
        state = state * g[:, :, t, None, None].exp()
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, :, t])  # S^T k_t
        delta = (v[:, :, t] - predicted) * beta[:, :, t, None]
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, :, t], delta)  # k_t (x) delta
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t]))  # S^T q_t
    out = torch.stack(outs, dim=2) if outs else v.new_zeros(v.shape)
    return _finish(out, state, out_dtype, dtype)


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None, *, scale: float | None = None):
    """The decode form: a fused update per token, float32 state (see the module docstring for shapes).

    Written as batched matmuls over (B, H) so that one step is three small matmuls; T is 1 when
    decoding, and a longer T simply unrolls (static shapes, so it traces into one graph).
    """
    out_dtype = v.dtype
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, initial_state, scale, torch.float32)
    outs = []
    for t in range(v.shape[2]):
        k_t = k[:, :, t, :, None]  # (B, H, dk, 1)
        state = state * g[:, :, t, None, None].exp()
        delta = (v[:, :, t, None, :] - k_t.transpose(-1, -2) @ state) * beta[:, :, t, None, None]  # (B, H, 1, dv)
        state = state + k_t @ delta
        outs.append((q[:, :, t, None, :] @ state).squeeze(-2))
    return _finish(torch.stack(outs, dim=2), state, out_dtype, torch.float32)


def unit_lower_triangular_inverse(strict_lower: torch.Tensor) -> torch.Tensor:
    """(I + L)^-1 for strictly lower-triangular L of shape (..., C, C), C a power of two.

    Recursive block inversion: the inverses of the diagonal blocks double in size at each level, using
    [[A, 0], [X, D]]^-1 = [[A^-1, 0], [-D^-1 X A^-1, D^-1]]. log2(C) levels of batched matmuls: static
    shapes and no triangular-solve op, so it exports and lowers to matmul hardware, with the accuracy of
    a triangular solve (no power series).
    """
    size = strict_lower.shape[-1]
    if size & (size - 1):
        raise ValueError(f"chunk size must be a power of two, got {size}")
    lead = strict_lower.shape[:-2]
    eye = torch.eye(size, dtype=strict_lower.dtype, device=strict_lower.device)
    system = eye + strict_lower.tril(-1)
    inverse_blocks = torch.ones(*lead, size, 1, 1, dtype=system.dtype, device=system.device)  # 1x1 diagonal
    block = 1
    while block < size:
        pairs = size // (2 * block)
        # The diagonal (2*block)-blocks of the system, as (..., pairs, 2*block, 2*block).
        diag = system.reshape(*lead, pairs, 2 * block, pairs, 2 * block).diagonal(dim1=-4, dim2=-2)
        lower_left = diag.movedim(-1, -3)[..., block:, :block]
        upper_inv = inverse_blocks[..., 0::2, :, :]
        lower_inv = inverse_blocks[..., 1::2, :, :]
        corner = -(lower_inv @ lower_left @ upper_inv)
        top = torch.cat([upper_inv, torch.zeros_like(upper_inv)], dim=-1)
        bottom = torch.cat([corner, lower_inv], dim=-1)
        inverse_blocks = torch.cat([top, bottom], dim=-2)
        block *= 2
    return inverse_blocks[..., 0, :, :]


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, *, scale: float | None = None,
                           chunk_size: int = CHUNK_SIZE):
    """The chunked (prefill) form (see the module docstring for shapes), float32 throughout.

    Inside a chunk the delta-rule updates are condensed with the UT transform into matmuls; chunks are then
    scanned sequentially. gc = cumsum(g) within the chunk; the pairwise decay exp(gc_i - gc_j) is formed
    only where j <= i (masked to -inf BEFORE the exp), where gc_i - gc_j <= 0, so it cannot overflow
    however negative g gets. Every other exp is also of a non-positive number. T is padded up to a
    multiple of `chunk_size` with beta = 0 and g = 0 steps, which leave the state untouched.
    """
    out_dtype = v.dtype
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, initial_state, scale, torch.float32)
    batch, heads, length, dv = v.shape
    pad = (-length) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    num_chunks = (length + pad) // chunk_size

    def chunked(x):  # (B, H, T, ...) -> (B, H, N, C, ...)
        return x.reshape(batch, heads, num_chunks, chunk_size, *x.shape[3:])

    q, k, v, g, beta = (chunked(x) for x in (q, k, v, g, beta))
    gc = g.cumsum(-1)  # (B, H, N, C): log of the decay from the chunk start to each step
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device).tril()
    pairwise = (gc[..., :, None] - gc[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # (..., C, C)

    k_beta = k * beta[..., None]
    transform = unit_lower_triangular_inverse((k_beta @ k.transpose(-1, -2)) * pairwise)
    new_values = transform @ (v * beta[..., None])  # "u": what each step writes, before the old state
    decayed_keys = transform @ (k_beta * gc.exp()[..., None])  # "w": how each step reads the old state
    intra = (q @ k.transpose(-1, -2)) * pairwise  # causal q.k inside the chunk, decayed
    q_decayed = q * gc.exp()[..., None]
    k_to_end = k * (gc[..., -1:] - gc).exp()[..., None]  # decay from each step to the chunk end
    chunk_decay = gc[..., -1].exp()[..., None, None]  # (B, H, N, 1, 1)

    outs = []
    for n in range(num_chunks):
        v_new = new_values[:, :, n] - decayed_keys[:, :, n] @ state
        outs.append(q_decayed[:, :, n] @ state + intra[:, :, n] @ v_new)
        state = state * chunk_decay[:, :, n] + k_to_end[:, :, n].transpose(-1, -2) @ v_new
    out = torch.stack(outs, dim=2).reshape(batch, heads, -1, dv)[:, :, :length]
    return _finish(out, state, out_dtype, torch.float32)
