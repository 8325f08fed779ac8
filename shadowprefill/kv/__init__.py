"""KV pages: layout spec, block pool (normal / capped shadow class, prefix cache) and the host spill tier."""
from .block_pool import BlockPool, PrefixMatch
from .host_tier import DEFAULT_CAPACITY_BYTES, HostTier
from .manager import KVCacheManager
from .prefix_hash import PageHashes, page_hashes, root_hash
from .spec import KVCacheSpec
from .stats import PoolStats

__all__ = ["KVCacheManager", "BlockPool", "PrefixMatch", "HostTier", "DEFAULT_CAPACITY_BYTES", "PageHashes", "page_hashes",
           "root_hash", "KVCacheSpec", "PoolStats"]
