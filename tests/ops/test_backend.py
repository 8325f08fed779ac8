"""The SHADOWPREFILL_BACKEND switch: read at call time, auto by device, clear errors."""
import sys

import pytest
import torch

from shadowprefill import ops
from shadowprefill.ops import _backend


def test_auto_picks_by_device(monkeypatch):
    monkeypatch.delenv("SHADOWPREFILL_BACKEND", raising=False)
    assert not _backend.use_triton(torch.device("cpu"))
    assert _backend.use_triton(torch.device("cuda"))
    monkeypatch.setenv("SHADOWPREFILL_BACKEND", "reference")
    assert not _backend.use_triton(torch.device("cuda"))
    monkeypatch.setenv("SHADOWPREFILL_BACKEND", "triton")
    assert _backend.use_triton(torch.device("cpu"))


def test_unknown_backend_is_rejected(monkeypatch):
    monkeypatch.setenv("SHADOWPREFILL_BACKEND", "cutlass")
    with pytest.raises(ValueError, match="SHADOWPREFILL_BACKEND='cutlass'"):
        ops.write_kv(torch.randn(1, 1, 8), torch.randn(1, 1, 8), torch.randn(2, 1, 2, 1, 4, 8), 0,
                     torch.tensor([3]))


def test_missing_triton_kernels_raise_a_clear_error(monkeypatch):
    monkeypatch.setenv("SHADOWPREFILL_BACKEND", "triton")
    monkeypatch.setitem(sys.modules, "shadowprefill.triton_kernels", None)  # import now fails
    monkeypatch.setattr(_backend, "_cache", {})
    with pytest.raises(RuntimeError, match="'triton' backend"):
        ops.write_kv(torch.randn(1, 1, 8), torch.randn(1, 1, 8), torch.randn(2, 1, 2, 1, 4, 8), 0,
                     torch.tensor([3]))


def test_triton_backend_reaches_the_kernels(monkeypatch):
    """With SHADOWPREFILL_BACKEND=triton the op calls shadowprefill.triton_kernels, on CPU tensors too."""
    calls = []

    class FakeKernels:  # write_kv and write_kv_cache share one kernel entry point: write_kv_cache
        @staticmethod
        def write_kv_cache(*args):
            calls.append(args)

    monkeypatch.setenv("SHADOWPREFILL_BACKEND", "triton")
    monkeypatch.setattr(_backend, "_cache", {"shadowprefill.triton_kernels": FakeKernels})
    ops.write_kv(torch.randn(1, 1, 8), torch.randn(1, 1, 8), torch.randn(2, 1, 2, 1, 4, 8), 0, torch.tensor([3]))
    assert len(calls) == 1
    monkeypatch.setattr(_backend, "_cache", {"shadowprefill.triton_kernels": object()})
    with pytest.raises(RuntimeError, match="no kernel for write_kv_cache"):
        ops.write_kv(torch.randn(1, 1, 8), torch.randn(1, 1, 8), torch.randn(2, 1, 2, 1, 4, 8), 0,
                     torch.tensor([3]))
