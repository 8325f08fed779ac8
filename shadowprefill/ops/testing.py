"""Random paged-attention batches: the one builder of the op tests (tests/ops), the kernel tests
(tests/triton) and the GPU device check (bench/devcheck_*.py).

A batch lives in a block-major pool [num_blocks, num_layers, 2, Hkv, block_size, D]. Every page a sequence
uses gets random K/V (all layers) for its positions < seq_len and NaN after (the unwritten tail); one more
page, `nan_page`, is all NaN. Table entries that must never be read point at `pad_id` (default: the NaN
page): the padding past each sequence's last page, the pages of sequences without new tokens and, with
`window`, the pages wholly before the first query's window. A kernel that reads one of them leaks NaN into
its output (even a masked-out score multiplies the NaN values by 0), so the tests see it. Only the pages of
the batch are written, so a pool can be a huge, mostly untouched allocation (int64 offset tests).
"""
import math
from typing import Optional, Sequence

import torch

NAN = float("nan")


class PagedBatch(dict):
    """The keyword arguments of ops.paged_attention / triton_kernels.paged_attention (q, kv_cache, layer,
    block_table, cu_seqlens_q, seq_lens, scale), plus `nan_page`, the all-NaN page's id."""
    nan_page: int


def nan_pool(num_blocks: int, num_layers: int, num_kv_heads: int, block_size: int, head_dim: int,
             dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """A block-major cache whose every element is NaN until a batch writes it."""
    return torch.full((num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim), NAN, dtype=dtype,
                      device=device)


def random_block_ids(num_blocks: int, count: int) -> list:
    """`count` distinct ids in random order, always including the largest id (index-overflow coverage)."""
    ids = torch.randperm(num_blocks)[:count]
    if count and not bool((ids == num_blocks - 1).any()):
        ids[torch.randint(count, ())] = num_blocks - 1
    return ids.tolist()


def random_batch(seqs: Sequence[tuple], pool: torch.Tensor, layer: int, num_q_heads: int,
                 block_ids: Optional[Sequence[int]] = None, window: Optional[int] = None,
                 pad_id: Optional[int] = None) -> PagedBatch:
    """A batch over `pool` for seqs = [(cached_context, q_len), ...], on the pool's device.

    `block_ids`: the pages to use in order, one more than the batch needs (the last becomes the NaN page);
    default random_block_ids. `window`: pages wholly before the first query's window point at `pad_id`.
    `pad_id` (default the NaN page) fills every entry that must not be read.
    """
    num_blocks, _, _, _, block_size, head_dim = pool.shape
    device = pool.device
    lens = [context + q_len for context, q_len in seqs]
    needed = [math.ceil(n / block_size) for n in lens]
    total = sum(needed)
    ids = list(block_ids) if block_ids is not None else random_block_ids(num_blocks, total + 1)
    if len(ids) < total + 1:
        raise ValueError(f"block_ids: {len(ids)} ids for {total} pages plus the NaN page")
    nan_page = int(ids[total])
    pool[nan_page] = NAN
    page_elems = pool[0].numel()
    step = max(1, (1 << 28) // max(1, page_elems * pool.element_size()))  # at most 256 MiB of new data at once
    for first in range(0, total, step):
        used = torch.tensor(ids[first:first + step], dtype=torch.int64, device=device)
        pool[used] = torch.randn((len(used),) + tuple(pool.shape[1:]), device=device, dtype=pool.dtype)
    pad = nan_page if pad_id is None else pad_id
    table = torch.full((len(seqs), max(needed + [0]) + 2), pad, dtype=torch.int32)
    offset = 0
    for s, ((context, q_len), length) in enumerate(zip(seqs, lens)):
        if needed[s]:
            last = int(ids[offset + needed[s] - 1])
            pool[last, :, :, :, length - (needed[s] - 1) * block_size:] = NAN  # unwritten tail
        table[s, :needed[s]] = torch.tensor(ids[offset:offset + needed[s]], dtype=torch.int32)
        first_visible = max(0, context - window + 1) if window else 0
        unread = needed[s] if q_len == 0 else first_visible // block_size  # pages j with (j+1)*bs <= first
        table[s, :unread] = pad
        offset += needed[s]
    q_lens = [q_len for _, q_len in seqs]
    cu = torch.tensor([0] + q_lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, device=device, dtype=pool.dtype)
    batch = PagedBatch(q=q, kv_cache=pool, layer=layer, block_table=table.to(device), cu_seqlens_q=cu.to(device),
                       seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
                       scale=1.0 / math.sqrt(head_dim))
    batch.nan_page = nan_page
    return batch
