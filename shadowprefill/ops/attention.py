"""paged_attention: causal attention of new query tokens over the paged KV cache (DESIGN.md §4).

One call serves any mix of decodes (q_len 1), prefill chunks on top of cached context and fresh prefills.
Token i of sequence s sits at position seq_lens[s] - q_len[s] + i and attends to the positions j <= its own
(and j > position - sliding_window when a window is set). Logits are scale * q.k, then
softcap * tanh(logits / softcap) when a softcap is set (Gemma-2).
"""
from typing import Optional

import torch

from . import _backend, _validate as check


def _check_structure(q, kv_cache, layer, block_table, cu_seqlens_q, seq_lens, scale, out, sliding_window,
                     softcap):
    check.tensor(q, "q", 3, check.FLOAT_DTYPES)
    check.kv_cache(kv_cache)
    check.same_dtype(kv_cache, "kv_cache", q.dtype, "q")
    check.device(kv_cache, "kv_cache", q.device, "q")
    _, num_layers, _, num_kv_heads, _, head_dim = kv_cache.shape
    check.integer(layer, "layer", 0, num_layers)
    if q.shape[2] != head_dim:
        raise ValueError(f"q: head_dim {q.shape[2]} differs from kv_cache head_dim {head_dim}")
    if q.shape[1] % num_kv_heads != 0:
        raise ValueError(f"q: {q.shape[1]} query heads is not a multiple of {num_kv_heads} kv heads (GQA)")
    check.tensor(block_table, "block_table", 2, (torch.int32,))
    check.device(block_table, "block_table", q.device, "q")
    num_seqs = block_table.shape[0]
    check.tensor(cu_seqlens_q, "cu_seqlens_q", 1, (torch.int32,))
    check.shape(cu_seqlens_q, "cu_seqlens_q", (num_seqs + 1,), "num_seqs + 1, from block_table")
    check.device(cu_seqlens_q, "cu_seqlens_q", q.device, "q")
    check.tensor(seq_lens, "seq_lens", 1, (torch.int32,))
    check.shape(seq_lens, "seq_lens", (num_seqs,), "num_seqs, from block_table")
    check.device(seq_lens, "seq_lens", q.device, "q")
    check.positive_float(scale, "scale")
    check.tensor(out, "out", 3)
    check.shape(out, "out", q.shape, "the shape of q")
    check.same_dtype(out, "out", q.dtype, "q")
    check.device(out, "out", q.device, "q")
    check.contiguous(out, "out")
    check.integer(sliding_window, "sliding_window", 0)
    if softcap < 0:
        raise ValueError(f"softcap: must be >= 0 (0 = off), got {softcap}")


def _first_position(seq_len, q_len, window: int):
    """First key position any query of the sequence can see (0 without a window)."""
    if window == 0:
        return seq_len * 0
    return (seq_len - q_len - window + 1).clamp(min=0)


def _check_values(num_tokens, kv_cache, block_table, cu_seqlens_q, seq_lens, window):
    """Offsets consistent, seq_lens >= q_len, and every page the op will read is a valid block id."""
    cu = cu_seqlens_q.cpu().long()
    lens = seq_lens.cpu().long()
    table = block_table.cpu()
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens_q: must start at 0, got {int(cu[0])}")
    q_lens = cu[1:] - cu[:-1]
    if bool((q_lens < 0).any()):
        raise ValueError("cu_seqlens_q: must be non-decreasing")
    if int(cu[-1]) != num_tokens:
        raise ValueError(f"cu_seqlens_q: last entry {int(cu[-1])} differs from the {num_tokens} tokens in q")
    short = (lens < q_lens).nonzero()
    if short.numel():
        s = int(short[0])
        raise ValueError(f"seq_lens: sequence {s} has seq_len {int(lens[s])} < its {int(q_lens[s])} new tokens")
    block_size = kv_cache.shape[4]
    active = q_lens > 0
    end_block = torch.where(active, (lens + block_size - 1) // block_size, 0)
    too_long = (end_block > table.shape[1]).nonzero()
    if too_long.numel():
        s = int(too_long[0])
        raise ValueError(f"block_table: sequence {s} needs {int(end_block[s])} blocks for seq_len "
                         f"{int(lens[s])}, but block_table has {table.shape[1]} columns")
    first_block = _first_position(lens, q_lens, window) // block_size
    cols = torch.arange(table.shape[1])
    read = (cols >= first_block[:, None]) & (cols < end_block[:, None])  # only the pages actually read
    check.ids_in_range(table[read], "block_table", kv_cache.shape[0])


def _reference(q, kv_cache, layer, block_table, cu_seqlens_q, seq_lens, scale, out, window, softcap):
    """Plain torch, float32 accumulation; gathers only positions < seq_len, so a NaN tail never enters."""
    block_size = kv_cache.shape[4]
    num_kv_heads = kv_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    layer_cache = kv_cache[:, layer]  # [num_blocks, 2, Hkv, block_size, D]
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        start, q_len = cu[s], cu[s + 1] - cu[s]
        if q_len == 0:
            continue
        first_query = seq_len - q_len
        lo = max(0, first_query - window + 1) if window else 0
        b0, b1 = lo // block_size, -(-seq_len // block_size)
        pages = layer_cache[block_table[s, b0:b1].long()]                  # [nb, 2, Hkv, bs, D]
        kv = pages.permute(1, 2, 0, 3, 4).reshape(2, num_kv_heads, -1, pages.shape[-1])
        kv = kv[:, :, lo - b0 * block_size: seq_len - b0 * block_size].float()  # positions lo .. seq_len-1
        k, v = kv[0], kv[1]                                                 # [Hkv, n, D]
        key_pos = torch.arange(lo, seq_len, device=q.device)
        rows = max(1, (1 << 24) // (q.shape[1] * key_pos.numel()))         # bound the logits' memory
        for i0 in range(0, q_len, rows):
            i1 = min(q_len, i0 + rows)
            qs = q[start + i0: start + i1].float().view(i1 - i0, num_kv_heads, group, -1)
            qs = qs.permute(1, 2, 0, 3).reshape(num_kv_heads, group * (i1 - i0), -1)
            logits = torch.bmm(qs, k.transpose(1, 2)).mul_(scale)            # [Hkv, g * rows, n]
            if softcap:
                logits = logits.div_(softcap).tanh_().mul_(softcap)
            query_pos = torch.arange(first_query + i0, first_query + i1, device=q.device)[:, None]
            hidden = key_pos[None, :] > query_pos                            # causal
            if window:
                hidden |= key_pos[None, :] <= query_pos - window
            logits = logits.view(num_kv_heads, group, i1 - i0, -1).masked_fill_(hidden, float("-inf"))
            probs = logits.softmax(dim=-1).view(num_kv_heads, group * (i1 - i0), -1)
            o = torch.bmm(probs, v).view(num_kv_heads, group, i1 - i0, -1)
            o = o.permute(2, 0, 1, 3).reshape(i1 - i0, q.shape[1], -1)
            out[start + i0: start + i1] = o.to(out.dtype)


@torch.library.custom_op("shadowprefill::paged_attention", mutates_args=("out",))
def _paged_attention_op(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_table: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor,
                        sliding_window: int, softcap: float) -> None:
    _check_structure(q, kv_cache, layer, block_table, cu_seqlens_q, seq_lens, scale, out, sliding_window,
                     softcap)
    if _backend.value_checks_enabled(q.device):
        _check_values(q.shape[0], kv_cache, block_table, cu_seqlens_q, seq_lens, sliding_window)
    if q.shape[0] == 0:
        return
    if _backend.use_triton(q.device):
        kernel = _backend.triton_kernel("paged_attention")
        kernel(q.contiguous(), kv_cache, layer, block_table.contiguous(), cu_seqlens_q.contiguous(),
               seq_lens.contiguous(), scale, out, sliding_window, softcap)
    else:
        _reference(q, kv_cache, layer, block_table, cu_seqlens_q, seq_lens, scale, out, sliding_window,
                   softcap)


@_paged_attention_op.register_fake
def _(q, kv_cache, layer, block_table, cu_seqlens_q, seq_lens, scale, out, sliding_window, softcap):
    _check_structure(q, kv_cache, layer, block_table, cu_seqlens_q, seq_lens, scale, out, sliding_window,
                     softcap)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_table: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    out: Optional[torch.Tensor] = None, sliding_window: Optional[int] = None,
                    softcap: Optional[float] = None) -> torch.Tensor:
    """Attention of the new tokens `q` [T, Hq, D] over layer `layer` of the paged `kv_cache`.

    block_table [S, max_blocks] int32, cu_seqlens_q [S+1] int32 (query offsets), seq_lens [S] int32
    (cached context + new tokens; the new tokens' K/V are already written). `out` (like q) is written and
    returned; allocated when None. `sliding_window` W > 0: a query at position p sees keys p-W < j <= p.
    `softcap` c > 0: logits = c * tanh(scale * q.k / c). Hq must be a multiple of Hkv (GQA).
    """
    check.tensor(q, "q")
    check.integer(layer, "layer", 0)
    window = 0 if sliding_window is None else check.integer(sliding_window, "sliding_window", 1)
    cap = 0.0 if softcap is None else check.positive_float(softcap, "softcap")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    for value, name in ((kv_cache, "kv_cache"), (block_table, "block_table"), (cu_seqlens_q, "cu_seqlens_q"),
                        (seq_lens, "seq_lens"), (out, "out")):
        check.tensor(value, name)
    scale = check.positive_float(scale, "scale")
    torch.ops.shadowprefill.paged_attention(q, kv_cache, layer, block_table, cu_seqlens_q, seq_lens, scale,
                                            out, window, cap)
    return out
