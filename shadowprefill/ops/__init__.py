"""The ops of shadowprefill, registered as torch custom ops in namespace `shadowprefill` (DESIGN.md §4).

    paged_attention(q, kv_cache, layer, block_table, cu_seqlens_q, seq_lens, scale, out=None,
                    sliding_window=None, softcap=None) -> out
    write_kv(key, value, kv_cache, layer, slot_mapping)
    copy_blocks(src, dst, src_block_ids, dst_block_ids)
    pack_blocks(kv_cache, block_ids, layers=None, quant=None) -> (buf, scales)
    unpack_blocks(buf, scales, kv_cache, block_ids, layers=None)

Backends (SHADOWPREFILL_BACKEND=auto|reference|triton) and debug value checks: see _backend.py.
"""
from .attention import paged_attention
from .kv_write import write_kv
from .page_copy import copy_blocks
from .pack import pack_blocks, unpack_blocks

__all__ = ["paged_attention", "write_kv", "copy_blocks", "pack_blocks", "unpack_blocks"]
