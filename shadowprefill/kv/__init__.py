"""KV pages: layout spec, the KV cache manager (page pool with a normal / capped shadow class, prefix index,
host offload tier, layer-wise reloads) and the page-hash chain. `page_hashes` imports without torch (the gateway uses it); the
rest is imported on first use."""
from .page_hash import PageHashes, page_hashes

__all__ = ["KVCacheManager", "PrefixMatch", "HostTier", "DEFAULT_CAPACITY_BYTES", "PageHashes", "page_hashes",
           "KVCacheSpec", "PoolStats", "ReloadBatch", "record_reloads"]

_LAZY = {"KVCacheManager": "manager", "PrefixMatch": "manager", "HostTier": "host_tier",
         "DEFAULT_CAPACITY_BYTES": "host_tier", "KVCacheSpec": "spec", "PoolStats": "stats",
         "ReloadBatch": "reload", "record_reloads": "reload"}


def __getattr__(name: str):
    if name in _LAZY:
        from importlib import import_module
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
