"""Shared test set-up.

- Without a CUDA GPU, the Triton kernels run under the interpreter: TRITON_INTERPRET=1 must be set before
  shadowprefill.triton_kernels is first imported, hence here, at collection start.
- `backend` fixture: "reference" or "triton" (sets SHADOWPREFILL_BACKEND); `device` follows it: the Triton
  half runs on CUDA tensors when a GPU is present, else on CPU tensors under the interpreter.
- tests/ops/matrix.py builds (backend, case) parameter lists for the op tests.
"""
import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `import reference` in any import mode


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=["reference", "triton"])
def backend(request, monkeypatch):
    monkeypatch.setenv("SHADOWPREFILL_BACKEND", request.param)
    return request.param


@pytest.fixture
def device(backend):
    return "cuda" if backend == "triton" and HAS_CUDA else "cpu"
