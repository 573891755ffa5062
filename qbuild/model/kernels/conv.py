"""Causal depthwise conv1d with a carried state (DeltaNet's short convolution over the QKV channels).

Shapes: x (B, C, T) channels-first, weight (C, K), conv state (B, C, K-1) = the last K-1 inputs seen,
oldest first. No activation here: the caller applies silu.
"""

from __future__ import annotations

import torch


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None = None,
                  seq_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefill form: out[t] = sum_j weight[:, j] * x[t - (K-1) + j], earlier inputs from `conv_state`.

    Args:
        x: (B, C, T) inputs.
        weight: (C, K) depthwise taps.
        conv_state: (B, C, K-1) inputs preceding x (zeros when None: the start of a sequence).
        seq_lens: (B,) number of real steps of each row when x is right-padded; the new state is then
            taken at each row's last real steps, so the padding never reaches it.
    Returns:
        out (B, C, T) and the new state (B, C, K-1).
    """
    batch, channels, length = x.shape
    taps = weight.shape[-1]
    if conv_state is None:
        conv_state = x.new_zeros(batch, channels, taps - 1)
    history = torch.cat([conv_state.to(x.dtype), x], dim=-1)  # (B, C, K-1+T); x[t] sits at t + K-1
    w = weight.to(x.dtype)
    out = sum(w[:, j, None] * history[:, :, j:j + length] for j in range(taps))
    if seq_lens is None:
        new_state = history[:, :, length:]
    else:
        # The last K-1 real inputs x[n-K+1 .. n-1] sit at history[n .. n+K-2].
        index = seq_lens.to(torch.long)[:, None] + torch.arange(taps - 1, device=x.device)
        new_state = history.gather(2, index[:, None, :].expand(batch, channels, taps - 1))
    return out, new_state


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor,
                         weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-step (decode) form. x (B, C), conv_state (B, C, K-1), weight (C, K) -> (out (B, C), new state)."""
    window = torch.cat([conv_state.to(x.dtype), x[:, :, None]], dim=-1)  # (B, C, K)
    out = (window * weight.to(x.dtype)).sum(-1)
    return out, window[:, :, 1:]
