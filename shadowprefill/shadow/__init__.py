"""Shadow prefill, engine-free: the shadow-job rules (§3.1; the jobs themselves are the engine's shadow
requests), the harvest controller (§3.2, Algorithm 1) on a read-only view of any engine's iteration, the
one budget-spending function (line 15), its policies and the latency predictor t̂."""
from .controller import ShadowBudget, ShadowController, default_tpot_slo, default_ttft_slo
from .jobs import common_prefix_length, supersede
from .policy import SHADOW_POLICIES, ShadowPolicy, get_shadow_policy
from .predictor import IterationPredictor
from .view import IterationView, RequestState

__all__ = ["ShadowBudget", "ShadowController", "default_tpot_slo", "default_ttft_slo", "common_prefix_length",
           "supersede", "SHADOW_POLICIES", "ShadowPolicy", "get_shadow_policy",
           "IterationPredictor", "IterationView", "RequestState"]
