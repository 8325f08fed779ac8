"""Simulates a vLLM release that renamed an internal the shadow scheduler uses (run.sh's version-gate check).

With this directory on PYTHONPATH, every Python process of a `vllm serve` (API server and EngineCore) renames
`KVCacheManager.get_computed_blocks` to `get_computed_blocks_v2` as vLLM's module is imported; the plugin's
version gate must then stop start-up with one message naming the supported range and the missing name.
"""
import importlib.abc
import importlib.util
import sys

TARGET, CLASS, OLD, NEW = "vllm.v1.core.kv_cache_manager", "KVCacheManager", "get_computed_blocks", \
    "get_computed_blocks_v2"


class _Rename(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        self._inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        cls = getattr(module, CLASS)
        setattr(cls, NEW, getattr(cls, OLD))
        delattr(cls, OLD)


sys.meta_path.insert(0, _Rename())
