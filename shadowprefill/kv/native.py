"""The native KV core: shadowprefill._C_kv, built from csrc/kv/ with the package (CPU-only C++, no libtorch).

`KVCacheManager(backend=None)` uses it when it was built; SHADOWPREFILL_KV_BACKEND=python|native changes that
default (e.g. to rerun a simulation on the Python reference). Both backends take the same decisions.
"""
from __future__ import annotations

import os

BACKENDS = ("python", "native")
_module = None


def native_module():
    """The compiled module (ImportError naming the build step if it is missing)."""
    global _module
    if _module is None:
        try:
            from shadowprefill import _C_kv
        except ImportError as e:
            raise ImportError("backend: the native KV core shadowprefill._C_kv is not built "
                              "(pip install -e . builds it with the package)") from e
        _module = _C_kv
    return _module


def native_available() -> bool:
    try:
        native_module()
    except ImportError:
        return False
    return True


def resolve_backend(backend: str | None) -> str:
    """backend, or the default: SHADOWPREFILL_KV_BACKEND if set, else native when built, else python."""
    if backend is None:
        backend = os.environ.get("SHADOWPREFILL_KV_BACKEND") or ("native" if native_available() else "python")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "native":
        native_module()
    return backend
