"""The ops of shadowprefill, registered as torch custom ops in namespace `shadowprefill` (DESIGN.md §4).

    paged_attention_kv(q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, scale, out=None,
                       sliding_window=None, softcap=None) -> out
    write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
        key_cache / value_cache: [num_blocks, block_size, Hkv, D] views of any engine's cache (any strides,
        contiguous last dim): vLLM kv[0] / kv[1], FlashInfer NHD / HND, kv[:, layer, 0].transpose(1, 2)
    paged_attention(q, kv_cache, layer, block_table, cu_seqlens_q, seq_lens, scale, out=None,
                    sliding_window=None, softcap=None) -> out
    write_kv(key, value, kv_cache, layer, slot_mapping)
        the same two on this project's block-major cache [num_blocks, L, 2, Hkv, block_size, D]
    copy_blocks(src, dst, src_block_ids, dst_block_ids, layers=None)
    pack_blocks(kv_cache, block_ids, layers=None, quant=None) -> (buf, scales)
    unpack_blocks(buf, scales, kv_cache, block_ids, layers=None)

`shadowprefill.ops.reference` holds the plain-torch reference of every op. Backends
(SHADOWPREFILL_BACKEND=auto|reference|triton) and debug value checks: see _backend.py.
"""
from . import reference
from .attention import paged_attention, paged_attention_kv
from .kv_write import write_kv, write_kv_cache
from .page_copy import copy_blocks
from .pack import pack_blocks, unpack_blocks

__all__ = ["paged_attention", "paged_attention_kv", "write_kv", "write_kv_cache", "copy_blocks", "pack_blocks",
           "unpack_blocks", "reference"]
