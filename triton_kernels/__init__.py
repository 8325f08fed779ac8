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
Under Triton 3.6's interpreter (the GPU machine's Triton, used for --dry-run checks there) with NumPy 2, a
scalar loaded from memory is a one-element 1-D array whose `__index__` (int(array)) raises a TypeError in
`range(lo, hi)` of a kernel loop; Triton 3.9 squeezes the array first, and so does the patch below
(applied only to an interpreter whose `__index__` lacks it).
"""
import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"



def _patch_interpreter_index() -> None:
    import inspect

    from triton.runtime import interpreter
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or "int(self.handle.data))" not in inspect.getsource(patch):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_index()

from . import launch  # noqa: E402
from .attention import paged_attention, paged_attention_kv  # noqa: E402
from .kv_write import write_kv, write_kv_cache  # noqa: E402
from .pack import pack_blocks, unpack_blocks  # noqa: E402

__all__ = ["paged_attention", "paged_attention_kv", "write_kv", "write_kv_cache", "pack_blocks",
           "unpack_blocks", "launch"]
