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


def test_full_value_checks_on_cuda_only_in_debug_mode(monkeypatch):
    """On CUDA the full checks (torch.unique / isin / device-to-host copies) would cost every call a sync or
    host work: only with SHADOWPREFILL_DEBUG=1. On the CPU they always run."""
    monkeypatch.delenv("SHADOWPREFILL_DEBUG", raising=False)
    assert _backend.value_checks_enabled(torch.device("cpu"))
    assert not _backend.value_checks_enabled(torch.device("cuda"))
    monkeypatch.setenv("SHADOWPREFILL_DEBUG", "1")
    assert _backend.value_checks_enabled(torch.device("cuda"))


def test_copy_value_checks_without_debug_keep_ranges_only(monkeypatch):
    """The non-debug CUDA path of copy_blocks: ids out of range still raise (host ids: a min and a max),
    duplicates / overlaps are left to SHADOWPREFILL_DEBUG=1 (no torch.unique / isin)."""
    from shadowprefill.ops import _validate, page_copy

    called = []
    monkeypatch.setattr(_validate, "unique", lambda *a: called.append("unique"))
    monkeypatch.setattr(torch, "isin", lambda *a: called.append("isin"))
    cache = torch.zeros(4, 1, 2, 1, 16, 8)
    page_copy._check_values(cache, cache, torch.tensor([0, 1]), torch.tensor([2, 2]), full=False)
    assert called == []
    with pytest.raises(ValueError, match="dst_block_ids: id 4"):
        page_copy._check_values(cache, cache, torch.tensor([0, 1]), torch.tensor([2, 4]), full=False)
