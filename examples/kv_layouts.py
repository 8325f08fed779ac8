"""Call shadowprefill's kernels on another engine's KV cache, in place: a vLLM-layout and a FlashInfer-layout
cache, no copy into this project's layout.

    python examples/kv_layouts.py                              # CPU: the plain-torch reference backend
    SHADOWPREFILL_BACKEND=triton python examples/kv_layouts.py # the Triton kernels (interpreter on CPU)
    python examples/kv_layouts.py --device cuda                # a GPU: the Triton kernels

Both caches hold one layer of paged K/V as [num_blocks, block_size, num_kv_heads, head_dim] views with
their engine's strides (contiguous head_dim):
  vLLM        kv [2, num_blocks, block_size, H, D]        -> key_cache = kv[0],  value_cache = kv[1]
  FlashInfer  kv [num_blocks, 2, block_size, H, D] (NHD)  -> key_cache = kv[:, 0], value_cache = kv[:, 1]
              kv [num_blocks, 2, H, block_size, D] (HND)  -> kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2)
One step of a batch of two sequences (a decode on 40 cached tokens and a 24-token prefill chunk on 9
cached tokens): write the new tokens' K/V with write_kv_cache, attend with paged_attention_kv, and check
the output against dense causal attention (shadowprefill.ops.reference) over the same keys.
"""
import argparse
import math

import torch

from shadowprefill import ops
from shadowprefill.ops import reference

NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, Q_HEADS, HEAD_DIM = 32, 16, 2, 8, 64
SEQS = [(40, 1), (9, 24)]  # (cached tokens, new tokens)


def caches(layout: str, device, dtype):
    """(storage, key_cache, value_cache) of an empty cache in `layout` (NaN = never written)."""
    nan = float("nan")
    if layout == "vLLM":
        kv = torch.full((2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM), nan, dtype=dtype, device=device)
        return kv, kv[0], kv[1]
    if layout == "FlashInfer NHD":
        kv = torch.full((NUM_BLOCKS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM), nan, dtype=dtype, device=device)
        return kv, kv[:, 0], kv[:, 1]
    kv = torch.full((NUM_BLOCKS, 2, KV_HEADS, BLOCK_SIZE, HEAD_DIM), nan, dtype=dtype, device=device)
    return kv, kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2)


def run(layout: str, device, dtype) -> float:
    torch.manual_seed(0)
    storage, key_cache, value_cache = caches(layout, device, dtype)
    lens = [c + n for c, n in SEQS]
    pages = torch.randperm(NUM_BLOCKS)                       # the engine's block allocator, in short
    tables, used = [], 0
    for length in lens:
        count = -(-length // BLOCK_SIZE)
        tables.append(pages[used:used + count])
        used += count
    block_table = torch.zeros(len(SEQS), max(len(t) for t in tables), dtype=torch.int32)
    for s, t in enumerate(tables):
        block_table[s, :len(t)] = t
    # every token's K/V (cached ones first, as the engine wrote them in earlier steps), slot = page * bs + offset
    keys = [torch.randn(n, KV_HEADS, HEAD_DIM, dtype=dtype, device=device) for n in lens]
    values = [torch.randn(n, KV_HEADS, HEAD_DIM, dtype=dtype, device=device) for n in lens]
    slots = torch.cat([tables[s][torch.arange(n) // BLOCK_SIZE] * BLOCK_SIZE + torch.arange(n) % BLOCK_SIZE
                       for s, n in enumerate(lens)]).to(device)
    ops.write_kv_cache(torch.cat(keys), torch.cat(values), key_cache, value_cache, slots)

    q_lens = [n for _, n in SEQS]
    q = torch.randn(sum(q_lens), Q_HEADS, HEAD_DIM, dtype=dtype, device=device)
    cu_seqlens_q = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32).to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    scale = 1 / math.sqrt(HEAD_DIM)
    out = ops.paged_attention_kv(q, key_cache, value_cache, block_table.to(device), cu_seqlens_q, seq_lens, scale)

    worst = 0.0
    for s in range(len(SEQS)):
        rows = slice(int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1]))
        expected = reference.dense_attention(q[rows].cpu(), keys[s].cpu(), values[s].cpu(), scale)
        worst = max(worst, float((out[rows].cpu().double() - expected).abs().max()))
    print(f"{layout:<15} storage {tuple(storage.shape)}  key_cache strides {tuple(key_cache.stride())}  "
          f"max |out - dense reference| = {worst:.2e}")
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    worst = max(run(layout, device, dtype) for layout in ("vLLM", "FlashInfer NHD", "FlashInfer HND"))
    print("ok" if worst < tolerance else f"FAILED: error {worst:.2e} >= {tolerance:g}")
    return 0 if worst < tolerance else 1


if __name__ == "__main__":
    raise SystemExit(main())
