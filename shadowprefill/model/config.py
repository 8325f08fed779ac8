"""Model hyper-parameters of the Llama-style decoder (Llama, Qwen2, Mistral families).

`ModelConfig` is a frozen, validated description of one architecture. Presets:

- `ModelConfig.tiny()` / `ModelConfig.tiny_large()`: two small models sharing one vocabulary, for CPU
  tests and the two-model (small / large) routing demo.
- `ModelConfig.from_arch(name)`: the real-size architectures of the paper's model pairs (e.g.
  "Llama-3.1-8B", "Qwen2.5-7B"), taken from `shadowprefill.model.catalog.MODELS`, for GPU benchmarks
  with random weights.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from shadowprefill.model.shape import ModelShape


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling of long-context checkpoints.

    `kind="llama3"`: Llama-3.1's smooth low/high-frequency interpolation; `kind="linear"`: every position
    divided by `factor` (position interpolation).
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("llama3", "linear"):
            raise ValueError(f"rope_scaling.kind must be 'llama3' or 'linear', got {self.kind!r}")
        if not self.factor > 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.kind == "llama3":
            if not 0 < self.low_freq_factor < self.high_freq_factor:
                raise ValueError("rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                                 f"{self.low_freq_factor}, {self.high_freq_factor}")
            if self.original_max_position <= 0:
                raise ValueError("rope_scaling.original_max_position must be > 0, got "
                                 f"{self.original_max_position}")


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


@dataclass(frozen=True)
class ModelConfig(ModelShape):
    """Shape of a Llama-style decoder: RMSNorm, RoPE, GQA attention, SwiGLU MLP.

    `qkv_bias` adds biases to the q/k/v projections (Qwen2). `tie_word_embeddings` reuses the embedding
    matrix as the LM head. `sliding_window` W (Mistral-7B-v0.1): a token at position p attends to
    positions p-W < j <= p only; None = full causal attention.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    max_position: int = 4096
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None
    name: str = "custom"

    def __post_init__(self) -> None:
        for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                      "intermediate_size", "max_position"):
            _check_positive_int(field, getattr(self, field))
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not (isinstance(self.rope_theta, (int, float)) and math.isfinite(self.rope_theta)
                and self.rope_theta > 0):
            raise ValueError(f"rope_theta must be a finite number > 0, got {self.rope_theta!r}")
        if not (isinstance(self.rms_norm_eps, (int, float)) and self.rms_norm_eps > 0):
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        for field in ("tie_word_embeddings", "qkv_bias"):
            if not isinstance(getattr(self, field), bool):
                raise TypeError(f"{field} must be a bool, got {getattr(self, field)!r}")
        if self.sliding_window is not None:
            _check_positive_int("sliding_window", self.sliding_window)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise TypeError(f"rope_scaling must be a RopeScaling or None, got {type(self.rope_scaling)}")

    # ----------------------------------------------------------------------------------- derived sizes
    @property
    def num_params(self) -> int:
        """Number of weights (embeddings and LM head included; a tied head is counted once)."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        per_layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * per_layer + h + head

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes of K and V cache one token occupies over all layers."""
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------------------------------------- presets
    @classmethod
    def tiny(cls, **overrides: Any) -> "ModelConfig":
        """A 140K-parameter model for CPU tests: a forward step takes milliseconds."""
        base = cls(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   intermediate_size=128, rope_theta=10000.0, max_position=4096, name="tiny")
        return base.replace(**overrides) if overrides else base

    @classmethod
    def tiny_large(cls, **overrides: Any) -> "ModelConfig":
        """The "large" model of the two-model demo: same vocabulary as `tiny()`, 690K parameters (5x)."""
        base = cls(vocab_size=512, hidden_size=128, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=16,
                   intermediate_size=256, rope_theta=10000.0, max_position=4096, name="tiny-large")
        return base.replace(**overrides) if overrides else base

    @classmethod
    def from_arch(cls, name: str, **overrides: Any) -> "ModelConfig":
        """The real-size config of a catalog architecture (`shadowprefill.model.catalog.MODELS`), for
        random-weight GPU benchmarks.

        Dense decoders with a gated MLP and softmax attention in every layer are supported (Llama, Qwen2,
        Mistral families; Gemma-7B with its shapes, its GeGLU / embedding scale not modelled, which change
        no shape or cost). Mixture-of-experts, linear-attention, non-gated-MLP, logit-softcap and
        partial-sliding-window architectures raise ValueError naming the feature.
        """
        from shadowprefill.model.catalog import MODELS

        if name not in MODELS:
            raise ValueError(f"unknown architecture name {name!r}; known: {sorted(MODELS)}")
        arch = MODELS[name]
        unsupported = [feature for feature, present in (
            ("mixture of experts", getattr(arch, "num_experts", 1) > 1),
            ("non-gated MLP", not getattr(arch, "gated_mlp", True)),
            ("attention output gate", getattr(arch, "attn_output_gate", False)),
            ("linear-attention layers", getattr(arch, "attention_layers", None) not in (None, arch.num_layers)),
            ("attention logit softcap", getattr(arch, "attn_logit_softcap", None) is not None),
            ("final logit softcap", getattr(arch, "final_logit_softcap", None) is not None),
            ("sliding window on some layers only",
             getattr(arch, "sliding_window_layers", 0) not in (0, arch.num_layers)),
        ) if present]
        if unsupported:
            raise ValueError(f"architecture {name!r} is not a Llama-style dense decoder: "
                             f"{', '.join(unsupported)} not supported")
        fields: dict[str, Any] = dict(
            vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, num_layers=arch.num_layers,
            num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
            intermediate_size=arch.intermediate_size, name=arch.name)
        for field in ("rope_theta", "max_position", "rms_norm_eps", "tie_word_embeddings", "qkv_bias"):
            if getattr(arch, field, None) is not None:
                fields[field] = getattr(arch, field)
        if getattr(arch, "sliding_window_layers", 0) == arch.num_layers:
            fields["sliding_window"] = arch.sliding_window
        fields.update(overrides)
        return cls(**fields)
