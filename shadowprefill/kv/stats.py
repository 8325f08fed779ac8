"""PoolStats: the accounting of a KVCacheManager and its HostTier that engines and the simulator read.

Counters accumulate from construction; gauges (`*_blocks`, `host_*`) are a snapshot taken when
`KVCacheManager.stats` is read. Pages are counted in pages, hits in tokens, transfers in pages and bytes.
Shadow accounting (paper §3.3, §5.4 "shadow waste"): a shadow page is *used* when a routed request hits it
(promotion) and *wasted* when its content leaves the last tier (device and host) without having been
promoted, or a shadow page is freed unregistered (a partial page of a dropped shadow job).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class PoolStats:
    block_size: int = 0
    # gauges: device pages by state and class
    num_blocks: int = 0
    free_blocks: int = 0
    normal_in_use_blocks: int = 0     # ref > 0
    shadow_in_use_blocks: int = 0
    normal_cached_blocks: int = 0     # ref 0, in the prefix cache, evictable
    shadow_cached_blocks: int = 0
    spilling_blocks: int = 0          # evicted, device->host copy in flight, not yet reusable
    shadow_cap_blocks: int = 0
    # gauges: host tier
    host_capacity_pages: int = 0
    host_normal_pages: int = 0
    host_shadow_pages: int = 0
    # counters: prefix lookups (acquire_prefix), in tokens
    lookups: int = 0
    lookup_tokens: int = 0            # tokens asked for (after max_tokens)
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    miss_tokens: int = 0
    shadow_hit_tokens: int = 0        # hit tokens that were on shadow-class pages
    # counters: allocation and eviction, in pages
    allocated_blocks: int = 0
    allocation_failures: int = 0
    normal_evictions: int = 0
    shadow_evictions: int = 0
    # counters: host tier transfers
    spills: int = 0                   # pages copied device -> host
    spill_bytes: int = 0
    spills_cancelled: int = 0         # pages hit again while their spill was in flight
    reloads: int = 0                  # pages copied host -> device
    reload_bytes: int = 0
    host_drops: int = 0               # host LRU pages dropped because the tier was full
    # counters: shadow usefulness
    shadow_blocks_allocated: int = 0
    shadow_blocks_promoted: int = 0
    shadow_blocks_wasted: int = 0

    @property
    def hit_tokens(self) -> int:
        return self.device_hit_tokens + self.host_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    @property
    def bytes_moved(self) -> int:
        return self.spill_bytes + self.reload_bytes

    @property
    def shadow_tokens_used(self) -> int:
        return self.shadow_blocks_promoted * self.block_size

    @property
    def shadow_tokens_wasted(self) -> int:
        return self.shadow_blocks_wasted * self.block_size

    def as_dict(self) -> dict:
        """All fields plus the derived quantities, as plain numbers (JSON-ready)."""
        d = asdict(self)
        for name in ("hit_tokens", "hit_rate", "bytes_moved", "shadow_tokens_used", "shadow_tokens_wasted"):
            d[name] = getattr(self, name)
        return d
