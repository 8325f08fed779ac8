"""KVCacheSpec: the shape of the block-major KV page (DESIGN.md §3).

One tensor per engine instance, [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim] (2 = K, V):
a page holds block_size tokens of all layers contiguously, so spilling, reloading or pushing a page is one
contiguous copy. Within a page the layout is head, token, dim. The host tier uses the same page shape.
"""
from dataclasses import dataclass

import torch

CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class KVCacheSpec:
    """Layout of one paged KV cache; `allocate` makes it, `check` verifies a tensor against it."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
            if value <= 0:
                raise ValueError(f"{name}: must be > 0, got {value}")
        if self.dtype not in CACHE_DTYPES:
            raise TypeError(f"dtype: must be one of float16, bfloat16, float32, got {self.dtype!r}")

    @classmethod
    def of(cls, kv_cache: torch.Tensor) -> "KVCacheSpec":
        """The spec of an existing cache tensor."""
        if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 6:
            raise ValueError("kv_cache: expected a 6-D tensor [num_blocks, num_layers, 2, num_kv_heads, "
                             "block_size, head_dim]")
        _, layers, _, heads, block_size, head_dim = kv_cache.shape
        spec = cls(layers, heads, head_dim, block_size, kv_cache.dtype)
        spec.check(kv_cache)
        return spec

    @property
    def page_shape(self) -> tuple:
        """Shape of one page: (num_layers, 2, num_kv_heads, block_size, head_dim)."""
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def page_numel(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.block_size * self.head_dim

    @property
    def page_bytes(self) -> int:
        return self.page_numel * self.dtype.itemsize

    def shape(self, num_blocks: int) -> tuple:
        return (num_blocks,) + self.page_shape

    def allocate(self, num_blocks: int, device="cpu", pin_memory: bool = False) -> torch.Tensor:
        """An uninitialised cache of `num_blocks` pages (torch.empty), optionally in pinned host memory."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int):
            raise TypeError(f"num_blocks: expected an int, got {type(num_blocks).__name__}")
        if num_blocks < 0:
            raise ValueError(f"num_blocks: must be >= 0, got {num_blocks}")
        device = torch.device(device)
        if pin_memory and device.type != "cpu":
            raise ValueError(f"pin_memory: only host (cpu) memory can be pinned, device is {device}")
        size = num_blocks * self.page_bytes
        try:
            return torch.empty(self.shape(num_blocks), dtype=self.dtype, device=device, pin_memory=pin_memory)
        except (RuntimeError, MemoryError) as e:
            kind = "pinned host" if pin_memory else str(device)
            raise RuntimeError(f"could not allocate {size} bytes ({size / 2**30:.2f} GiB) of {kind} memory for "
                               f"{num_blocks} KV pages of {self.page_bytes} bytes: {e}") from e

    def check(self, kv_cache: torch.Tensor) -> None:
        """Raise TypeError / ValueError (naming `kv_cache`) unless kv_cache is a contiguous cache of this spec."""
        if not isinstance(kv_cache, torch.Tensor):
            raise TypeError(f"kv_cache: expected a torch.Tensor, got {type(kv_cache).__name__}")
        if kv_cache.dtype != self.dtype:
            raise TypeError(f"kv_cache: dtype {kv_cache.dtype}, spec says {self.dtype}")
        if kv_cache.dim() != 6 or tuple(kv_cache.shape[1:]) != self.page_shape:
            raise ValueError(f"kv_cache: shape {tuple(kv_cache.shape)}, spec says [num_blocks, "
                             f"{', '.join(map(str, self.page_shape))}]")
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache: must be contiguous")
