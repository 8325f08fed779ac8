"""Building blocks of the Llama-style decoder: Linear, Embedding, RMSNorm and the SwiGLU MLP.

Parameters are allocated uninitialised (`torch.empty`) on the target device and dtype; `Llama` fills
them from a seed or a checkpoint. This keeps an 8B-parameter model from being initialised twice.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """An uninitialised, frozen (inference-only) parameter."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b), W: [out_features, in_features]. No init of its own (see module docstring)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.weight = empty_param(out_features, in_features, dtype=dtype, device=device)
        self.bias = empty_param(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """Token embedding table [vocab_size, hidden_size]."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.weight = empty_param(vocab_size, hidden_size, dtype=dtype, device=device)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32 and cast back to x's dtype."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_param(hidden_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up share one fused [2 * intermediate, hidden] weight."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, False, dtype, device)
        self.down_proj = Linear(intermediate_size, hidden_size, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
