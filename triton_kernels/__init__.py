"""Triton kernels behind the CUDA path of shadowprefill.ops (installed as shadowprefill.triton_kernels).

Entry points (inputs already validated by shadowprefill.ops; no host sync anywhere in a launch):
  paged_attention_kv(q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, scale, out,
                     sliding_window=0, softcap=0.0, tiles=None) -> None
  write_kv_cache(key, value, key_cache, value_cache, slot_mapping) -> None
      key_cache / value_cache: [num_blocks, block_size, Hkv, D] views, any strides, contiguous last dim
  paged_attention(q, kv_cache, layer, ...), write_kv(key, value, kv_cache, layer, slot_mapping): the same
      on layer `layer` of the block-major cache [num_blocks, L, 2, Hkv, block_size, D]
  pack_blocks(kv_cache, block_ids, layer_start, layer_end, quant=None) -> (buf, scales)
  unpack_blocks(buf, scales, kv_cache, block_ids, layer_start, layer_end) -> None
launch.forced_splits(n) / launch.forced_tiles(...) force the split count / tiles (tests, tile sweeps).

On a machine without CUDA the kernels can only run under Triton's interpreter, which reads
TRITON_INTERPRET when a kernel is decorated, i.e. when this package is imported: so here, when CUDA is not
available and the variable is unset, it is set to 1 before the kernel modules are imported.
"""
import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from . import launch  # noqa: E402
from .attention import paged_attention, paged_attention_kv  # noqa: E402
from .kv_write import write_kv, write_kv_cache  # noqa: E402
from .pack import pack_blocks, unpack_blocks  # noqa: E402

__all__ = ["paged_attention", "paged_attention_kv", "write_kv", "write_kv_cache", "pack_blocks",
           "unpack_blocks", "launch"]
