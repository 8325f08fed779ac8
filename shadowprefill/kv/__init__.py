"""KV management: page layout (spec), block pool, host tier."""
from .spec import KVCacheSpec
