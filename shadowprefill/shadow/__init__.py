"""Shadow prefill: incremental shadow jobs (§3.1) and the harvest controller (§3.2, Algorithm 1)."""
from .controller import ShadowChunk, ShadowController
from .jobs import ShadowJob, ShadowJobQueue, common_prefix_length

__all__ = ["ShadowChunk", "ShadowController", "ShadowJob", "ShadowJobQueue", "common_prefix_length"]
