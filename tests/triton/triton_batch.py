"""Where the kernel tests run: CUDA when present, else the CPU under TRITON_INTERPRET=1 (tests/conftest.py).
The batches come from shadowprefill.ops.testing (the one builder of tests/ops, tests/triton and bench/).
"""
import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
# Triton 3.9's interpreter computes tl.dot on bf16 operands wrongly on the CPU machine: bf16 attention runs
# only on a GPU.
ATTENTION_DTYPES = (torch.float32, torch.float16) + ((torch.bfloat16,) if HAS_CUDA else ())
