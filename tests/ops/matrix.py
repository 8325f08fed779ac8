"""(backend, case) parameter lists: the full matrix on the reference backend, a smaller one (pairwise
coverage, every feature present) on the Triton kernels, which run slowly under the interpreter on CPU."""
import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

# Triton 3.9's interpreter computes tl.dot on bf16 operands wrongly on this CPU: bf16 runs on the reference
# backend here and on the Triton kernels only on a GPU.
TRITON_DTYPES = (torch.float32, torch.float16) + ((torch.bfloat16,) if HAS_CUDA else ())


def _case_id(case) -> str:
    parts = case if isinstance(case, tuple) else (case,)
    return "-".join(str(p).replace("torch.", "") for p in parts)


def backend_cases(full_cases, triton_cases):
    """pytest params for ("backend", "case"), to use with indirect=["backend"]."""
    return ([pytest.param("reference", c, id=f"reference-{_case_id(c)}") for c in full_cases]
            + [pytest.param("triton", c, id=f"triton-{_case_id(c)}") for c in triton_cases])
