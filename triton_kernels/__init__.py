"""Triton kernels behind the CUDA path of shadowprefill.ops (installed as shadowprefill.triton_kernels).

Entry points (inputs already validated by shadowprefill.ops; no host sync anywhere in a launch):
  paged_attention(q, kv_cache, layer, block_table, cu_seqlens_q, seq_lens, scale, out,
                  sliding_window=0, softcap=0.0) -> None
  write_kv(key, value, kv_cache, layer, slot_mapping) -> None
  pack_blocks(kv_cache, block_ids, layer_start, layer_end, quant=None) -> (buf, scales)
  unpack_blocks(buf, scales, kv_cache, block_ids, layer_start, layer_end) -> None
launch.forced_splits(n) forces the split-KV path (tests, benchmarks).

On a machine without CUDA the kernels can only run under Triton's interpreter, which reads
TRITON_INTERPRET when a kernel is decorated, i.e. when this package is imported: so here, when CUDA is not
available and the variable is unset, it is set to 1 before the kernel modules are imported.
"""
import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from . import launch  # noqa: E402
from .attention import paged_attention  # noqa: E402
from .kv_write import write_kv  # noqa: E402
from .pack import pack_blocks, unpack_blocks  # noqa: E402

__all__ = ["paged_attention", "write_kv", "pack_blocks", "unpack_blocks", "launch"]
