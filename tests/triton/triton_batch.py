"""Random paged-attention batches for the kernel tests (tests/triton), on CPU (interpreter) or CUDA.

Unlike tests/ops/batch.py this builder never touches pages it does not use, so a pool can be a huge,
mostly untouched allocation (int64 offset tests), and it lets a test point table entries that must never
be read (padding, pages before a sliding window, rows of sequences without new tokens) at an all-NaN page:
reading one leaks NaN into the output, since even a masked-out score multiplies the NaN values by 0.
"""
import math

import torch

NAN = float("nan")
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
# Triton 3.9's interpreter computes tl.dot on bf16 operands wrongly on the CPU machine: bf16 attention runs
# only on a GPU.
ATTENTION_DTYPES = (torch.float32, torch.float16) + ((torch.bfloat16,) if HAS_CUDA else ())


def build(seqs, pool, layer, num_q_heads, block_ids=None, window=None):
    """A batch over `pool` for seqs = [(cached_context, q_len), ...] -> dict of paged_attention args.

    Used pages get random K/V (all layers) for positions < seq_len and NaN after. `block_ids`: the ids to
    use, the last one becomes the NaN page (default: a random permutation of the pool). With `window`,
    pages wholly before the first query's window point at the NaN page.
    """
    num_blocks, _, _, _, block_size, head_dim = pool.shape
    lens = [context + q_len for context, q_len in seqs]
    needed = [math.ceil(n / block_size) for n in lens]
    if block_ids is None:
        block_ids = torch.randperm(num_blocks)[:sum(needed) + 1].tolist()
    nan_page = int(block_ids[sum(needed)])
    pool[nan_page] = NAN
    table = torch.full((len(seqs), max(needed + [0]) + 2), nan_page, dtype=torch.int32)
    used = 0
    for s, ((context, q_len), length) in enumerate(zip(seqs, lens)):
        first_visible = max(0, context - window + 1) if window else 0
        for j in range(needed[s]):
            block = int(block_ids[used])
            used += 1
            page = torch.randn(pool.shape[1:], dtype=torch.float32).to(pool.dtype)
            page[:, :, :, min(block_size, length - j * block_size):] = NAN  # unwritten tail
            pool[block] = page.to(pool.device)
            unread = q_len == 0 or (j + 1) * block_size <= first_visible
            table[s, j] = nan_page if unread else block
    q_lens = [q_len for _, q_len in seqs]
    cu = torch.tensor([0] + q_lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, dtype=torch.float32).to(pool.dtype)
    device = pool.device
    return dict(q=q.to(device), kv_cache=pool, layer=layer, block_table=table.to(device),
                cu_seqlens_q=cu.to(device), seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
                scale=1.0 / math.sqrt(head_dim))


def nan_pool(num_blocks, num_layers, num_kv_heads, block_size, head_dim, dtype, device=DEVICE):
    return torch.full((num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim), NAN, dtype=dtype,
                      device=device)
