"""paged_attention_kv / paged_attention: causal attention of new query tokens over a paged KV cache
(DESIGN.md §4).

One call serves any mix of decodes (q_len 1), prefill chunks on top of cached context and fresh prefills.
Token i of sequence s sits at position seq_lens[s] - q_len[s] + i and attends to the positions j <= its own
(and j > position - sliding_window when a window is set). Logits are scale * q.k, then
softcap * tanh(logits / softcap) when a softcap is set (Gemma-2).

paged_attention_kv takes any engine's layout: key_cache / value_cache [num_blocks, block_size, Hkv, D] with
any strides but a contiguous last dimension (vLLM kv[0] / kv[1], FlashInfer NHD kv[:, 0] / kv[:, 1] and HND
kv[:, 0].transpose(1, 2), this project's page kv[:, layer, 0].transpose(1, 2)). paged_attention on the
block-major cache is a thin wrapper: it takes those views of layer `layer` and runs the same code.
"""
from typing import Optional

import torch

from . import _backend, _validate as check, reference


def _check_structure(q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, scale, out, sliding_window,
                     softcap):
    check.tensor(q, "q", 3, check.FLOAT_DTYPES)
    _, _, num_kv_heads, head_dim = check.kv_views(key_cache, value_cache)
    check.same_dtype(key_cache, "key_cache", q.dtype, "q")
    check.device(key_cache, "key_cache", q.device, "q")
    if q.shape[2] != head_dim:
        raise ValueError(f"q: head_dim {q.shape[2]} differs from the cache's head_dim {head_dim}")
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


def _check_values(num_tokens, num_blocks, block_size, block_table, cu_seqlens_q, seq_lens, window):
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
    check.ids_in_range(table[read], "block_table", num_blocks)


def _run(q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, scale, out, sliding_window, softcap):
    """The implementation behind both custom ops (structure already checked)."""
    if _backend.value_checks_enabled(q.device):
        _check_values(q.shape[0], key_cache.shape[0], key_cache.shape[1], block_table, cu_seqlens_q, seq_lens,
                      sliding_window)
    if q.shape[0] == 0:
        return
    if _backend.use_triton(q.device):
        _backend.triton_kernel("paged_attention_kv")(
            q.contiguous(), key_cache, value_cache, block_table.contiguous(), cu_seqlens_q.contiguous(),
            seq_lens.contiguous(), scale, out, sliding_window, softcap)
    else:
        reference.paged_attention_kv(q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, scale,
                                     sliding_window, softcap, out=out, dtype=torch.float32)


@torch.library.custom_op("shadowprefill::paged_attention_kv", mutates_args=("out",))
def _paged_attention_kv_op(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, out: torch.Tensor, sliding_window: int, softcap: float) -> None:
    _check_structure(q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, scale, out, sliding_window,
                     softcap)
    _run(q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, scale, out, sliding_window, softcap)


@_paged_attention_kv_op.register_fake
def _(q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, scale, out, sliding_window, softcap):
    _check_structure(q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, scale, out, sliding_window,
                     softcap)


def _check_layer(q, kv_cache, layer):
    """The block-major cache, named as such in errors; returns its K/V views of `layer`."""
    check.tensor(q, "q", 3, check.FLOAT_DTYPES)
    check.kv_cache(kv_cache)
    check.same_dtype(kv_cache, "kv_cache", q.dtype, "q")
    check.device(kv_cache, "kv_cache", q.device, "q")
    check.integer(layer, "layer", 0, kv_cache.shape[1])
    if q.shape[2] != kv_cache.shape[5]:
        raise ValueError(f"q: head_dim {q.shape[2]} differs from kv_cache head_dim {kv_cache.shape[5]}")
    return reference.layer_views(kv_cache, layer)


@torch.library.custom_op("shadowprefill::paged_attention", mutates_args=("out",))
def _paged_attention_op(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_table: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor,
                        sliding_window: int, softcap: float) -> None:
    key_cache, value_cache = _check_layer(q, kv_cache, layer)
    _check_structure(q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, scale, out, sliding_window,
                     softcap)
    _run(q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, scale, out, sliding_window, softcap)


@_paged_attention_op.register_fake
def _(q, kv_cache, layer, block_table, cu_seqlens_q, seq_lens, scale, out, sliding_window, softcap):
    key_cache, value_cache = _check_layer(q, kv_cache, layer)
    _check_structure(q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, scale, out, sliding_window,
                     softcap)


def _options(q, out, sliding_window, softcap):
    """Python-level argument normalisation shared by both wrappers: (out, window, softcap)."""
    window = 0 if sliding_window is None else check.integer(sliding_window, "sliding_window", 0)
    cap = 0.0 if softcap is None else check.non_negative_float(softcap, "softcap")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    check.tensor(out, "out")
    return out, window, cap


def paged_attention_kv(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       block_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                       out: Optional[torch.Tensor] = None, sliding_window: Optional[int] = None,
                       softcap: Optional[float] = None) -> torch.Tensor:
    """Attention of the new tokens `q` [T, Hq, D] over any engine's paged K/V cache.

    key_cache / value_cache: [num_blocks, block_size, Hkv, D] views with any strides but a contiguous last
    dimension, e.g. vLLM's per-layer kv[0] / kv[1] of [2, num_blocks, block_size, Hkv, D], FlashInfer's
    NHD kv[:, 0] / kv[:, 1] of [num_blocks, 2, block_size, Hkv, D] or HND kv[:, 0].transpose(1, 2) of
    [num_blocks, 2, Hkv, block_size, D]. No copy is made. block_table [S, max_blocks] int32,
    cu_seqlens_q [S+1] int32 (query offsets), seq_lens [S] int32 (cached context + new tokens; the new
    tokens' K/V are already written). `out` (like q, contiguous) is written and returned; allocated when
    None. `sliding_window` W > 0: a query at position p sees keys p-W < j <= p; None or 0 means no window.
    `softcap` c > 0: logits = c * tanh(scale * q.k / c); None or 0.0 means no softcap. Hq must be a
    multiple of Hkv (GQA).
    """
    check.tensor(q, "q")
    for value, name in ((key_cache, "key_cache"), (value_cache, "value_cache"), (block_table, "block_table"),
                        (cu_seqlens_q, "cu_seqlens_q"), (seq_lens, "seq_lens")):
        check.tensor(value, name)
    out, window, cap = _options(q, out, sliding_window, softcap)
    scale = check.positive_float(scale, "scale")
    torch.ops.shadowprefill.paged_attention_kv(q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens,
                                               scale, out, window, cap)
    return out


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_table: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    out: Optional[torch.Tensor] = None, sliding_window: Optional[int] = None,
                    softcap: Optional[float] = None) -> torch.Tensor:
    """paged_attention_kv over layer `layer` of this project's block-major `kv_cache`
    [num_blocks, num_layers, 2, Hkv, block_size, D] (views kv_cache[:, layer, 0 / 1].transpose(1, 2)).
    sliding_window / softcap as there: None, 0 and 0.0 mean off."""
    check.tensor(q, "q")
    check.integer(layer, "layer", 0)
    for value, name in ((kv_cache, "kv_cache"), (block_table, "block_table"), (cu_seqlens_q, "cu_seqlens_q"),
                        (seq_lens, "seq_lens")):
        check.tensor(value, name)
    out, window, cap = _options(q, out, sliding_window, softcap)
    scale = check.positive_float(scale, "scale")
    torch.ops.shadowprefill.paged_attention(q, kv_cache, layer, block_table, cu_seqlens_q, seq_lens, scale,
                                            out, window, cap)
    return out
