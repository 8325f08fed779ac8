"""Shadow prefill, engine-free: shadow jobs (§3.1), the harvest controller (§3.2, Algorithm 1) on a read-only
view of any engine's iteration, its policies and the latency predictor t̂."""
from .controller import ShadowBudget, ShadowController, default_tpot_slo, default_ttft_slo
from .jobs import ShadowChunk, ShadowJob, ShadowJobQueue, common_prefix_length
from .policy import SHADOW_POLICIES, ShadowPolicy, get_shadow_policy
from .predictor import IterationPredictor
from .view import IterationView, RequestState

__all__ = ["ShadowBudget", "ShadowController", "default_tpot_slo", "default_ttft_slo", "ShadowChunk", "ShadowJob",
           "ShadowJobQueue", "common_prefix_length", "SHADOW_POLICIES", "ShadowPolicy", "get_shadow_policy",
           "IterationPredictor", "IterationView", "RequestState"]
