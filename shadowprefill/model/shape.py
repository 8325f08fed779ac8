"""What every model description shares: the attention widths derived from its heads, defined once.

The catalog's `ModelArch` (the paper's public architectures and prices) and the engine's `ModelConfig` (a
model to build and run) are both a `ModelShape`; the roofline latency model reads either. No torch here.
"""
from __future__ import annotations


class ModelShape:
    """Mixin of a model description with `num_heads`, `num_kv_heads` and `head_dim` fields."""

    __slots__ = ()

    @property
    def q_size(self) -> int:
        """Width of the query projection output (num_heads * head_dim)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of each of the key / value projection outputs (num_kv_heads * head_dim)."""
        return self.num_kv_heads * self.head_dim
