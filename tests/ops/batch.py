"""Builders of random paged-attention batches for the op tests (pages poisoned with NaN where unwritten)."""
import math

import torch

NAN = float("nan")


def new_pool(num_blocks, num_layers, num_kv_heads, block_size, head_dim, dtype, device="cpu"):
    """A cache whose every element is NaN until a test writes it."""
    return torch.full((num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim), NAN, dtype=dtype,
                      device=device)


def random_block_ids(num_blocks, count):
    """`count` distinct ids in random order, always including the largest id (index-overflow coverage)."""
    ids = torch.randperm(num_blocks)[:count]
    if count and not bool((ids == num_blocks - 1).any()):
        ids[torch.randint(count, ())] = num_blocks - 1
    return ids


def make_batch(seqs, pool, layer, num_q_heads, pad_id=None):
    """A batch over `pool` for seqs = [(cached_context, q_len), ...].

    Every page the batch uses gets random K/V for positions < seq_len (all layers) and NaN after; one
    extra page (`nan_page`) stays all NaN and pads the block table (and any page a sliding window skips
    is left unread by the test's own choice of table entries: see `skipped`). Returns a dict of the op
    arguments plus `nan_page`.
    """
    num_blocks, _, _, _, block_size, head_dim = pool.shape
    lens = [context + q_len for context, q_len in seqs]
    needed = [math.ceil(length / block_size) for length in lens]
    ids = random_block_ids(num_blocks, sum(needed) + 1)
    nan_page = int(ids[-1])
    pool[nan_page] = NAN
    pad = nan_page if pad_id is None else pad_id
    table = torch.full((len(seqs), max(needed + [0]) + 1), pad, dtype=torch.int32)
    used = 0
    for s, length in enumerate(lens):
        for j in range(needed[s]):
            block = int(ids[used])
            used += 1
            table[s, j] = block
            valid = min(block_size, length - j * block_size)
            page = torch.randn(pool.shape[1:], dtype=torch.float32).to(pool.dtype)
            page[:, :, :, valid:] = NAN  # unwritten tail of a partial last block
            pool[block] = page.to(pool.device)
    q_lens = [q_len for _, q_len in seqs]
    cu = torch.tensor([0] + q_lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, dtype=torch.float32).to(pool.dtype)
    device = pool.device
    return dict(q=q.to(device), kv_cache=pool, layer=layer, block_table=table.to(device),
                cu_seqlens_q=cu.to(device), seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
                scale=1.0 / math.sqrt(head_dim), nan_page=nan_page)


def op_args(batch):
    return {k: v for k, v in batch.items() if k != "nan_page"}
