"""Backend choice for the ops: the Triton kernels, the compiled extensions, or plain torch.

`SHADOWPREFILL_BACKEND` (read at every call, a dict lookup):
  auto       Triton / CUDA on CUDA tensors, the reference implementations on CPU tensors (default);
  reference  plain torch (and the `_C` page copies) on every device;
  triton     the Triton kernels even on CPU tensors (they run under `TRITON_INTERPRET=1`, which Triton
             reads when a kernel is decorated: so on a machine without CUDA, importing shadowprefill.ops
             sets it when unset, before anything imports Triton; set it yourself if your code imports
             Triton before shadowprefill).
Value checks (ids in range, unique destinations, consistent offsets) always run for ops on CPU tensors.
For ops on CUDA tensors they would cost a device-to-host copy (or host-side torch.unique / isin per call),
so there only what is free runs by default (ranges of ids the caller already keeps on the host; the CUDA
copy extension checks its ranges itself) and `SHADOWPREFILL_DEBUG=1` turns on the full checks.
"""
import importlib
import os

import torch

BACKENDS = ("auto", "reference", "triton")

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before torch's dispatch of the first op imports Triton

_cache = {}


def backend_name() -> str:
    """The backend selected by SHADOWPREFILL_BACKEND (default "auto")."""
    name = os.environ.get("SHADOWPREFILL_BACKEND", "auto") or "auto"
    if name not in BACKENDS:
        raise ValueError(f"SHADOWPREFILL_BACKEND={name!r}: expected one of {', '.join(BACKENDS)}")
    return name


def use_triton(device: torch.device) -> bool:
    """True when an op on tensors of `device` should run the Triton kernels."""
    name = backend_name()
    if name == "auto":
        return device.type == "cuda"
    return name == "triton"


def value_checks_enabled(device: torch.device) -> bool:
    """Full value checks for an op computing on `device`: always on the CPU, with SHADOWPREFILL_DEBUG=1 on CUDA."""
    return device.type == "cpu" or os.environ.get("SHADOWPREFILL_DEBUG", "0") == "1"


def _import(module: str, what: str):
    if module not in _cache:
        try:
            _cache[module] = importlib.import_module(module)
        except ImportError as e:
            raise RuntimeError(f"{what} is not available: cannot import {module} ({e})") from e
    return _cache[module]


def triton_kernel(name: str):
    """Entry point `name` of shadowprefill.triton_kernels, imported on first use."""
    module = _import("shadowprefill.triton_kernels", f"the 'triton' backend (op {name})")
    fn = getattr(module, name, None)
    if fn is None:
        raise RuntimeError(f"the 'triton' backend has no kernel for {name}: "
                           f"shadowprefill.triton_kernels.{name} is missing")
    return fn


def cpu_extension():
    """The compiled CPU extension shadowprefill._C (page copies)."""
    return _import("shadowprefill._C", "the compiled CPU extension shadowprefill._C (run `pip install -e .`)")


def cuda_extension():
    """The compiled CUDA extension shadowprefill._C_cuda, imported lazily on the first CUDA copy."""
    return _import("shadowprefill._C_cuda",
                   "the compiled CUDA extension shadowprefill._C_cuda (built where nvcc is found)")
