"""shadowprefill: paged-KV kernels and the serving machinery for shadow prefill (see README.md).

Subpackages are imported on demand (`import shadowprefill.ops`, `from shadowprefill.kv import KVCacheSpec`),
so importing the package itself is cheap and needs neither CUDA nor the compiled extensions.
"""
__version__ = "0.1.0"
