"""Rotary position embedding (RoPE), in the half-split ("rotate half") convention of Hugging Face Llama.

A head vector x = [x1, x2] (two halves of head_dim/2) at position p becomes
[x1 cos(p f) - x2 sin(p f), x2 cos(p f) + x1 sin(p f)] with frequencies f_j = theta^(-2j / head_dim).
Positions come from the batch, so chunked prefill and decode rotate each token by its absolute position.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from shadowprefill.model.config import RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """Per-pair rotation frequencies [head_dim // 2] (float32), with optional long-context scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq.float()
    if scaling.kind == "linear":
        return (inv_freq / scaling.factor).float()
    # Llama-3.1 scaling: long wavelengths are slowed by `factor`, short ones kept, a smooth blend between.
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position / scaling.high_freq_factor
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, blended)
    scaled = torch.where(wavelen < high_freq_wavelen, inv_freq, scaled)
    return scaled.float()


class RotaryEmbedding(nn.Module):
    """Computes the RoPE rotation (cos, sin) of each token from its absolute position."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of positions [T] times the frequencies: each [T, 1, head_dim // 2] float32."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return angles.cos()[:, None, :], angles.sin()[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate heads x [T, H, D] by (cos, sin) [T, 1, D/2]; float32 math, result in x's dtype."""
    half = x.shape[-1] // 2
    x1 = x[..., :half].float()
    x2 = x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
