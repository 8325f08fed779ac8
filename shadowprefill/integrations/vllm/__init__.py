"""Shadow prefill inside vLLM: `ShadowScheduler` for `vllm serve --scheduler-cls
shadowprefill.integrations.vllm.ShadowScheduler --scheduling-policy priority --enable-prefix-caching`.

`ShadowScheduler` (scheduler.py; it becomes `AsyncShadowScheduler` under vLLM's async scheduling) imports vLLM
and is loaded on first access, after the version gate (`compat.require`) checked every vLLM internal it uses,
so `config`, `compat`, `shadow_kv`, `stats` and `metrics` import without vLLM (and none of this needs the
compiled extension).
"""
from shadowprefill.integrations.vllm.config import ENV_VAR, ShadowSchedulerConfig

__all__ = ["ENV_VAR", "ShadowSchedulerConfig", "ShadowScheduler", "AsyncShadowScheduler", "ShadowStatLogger"]


def __getattr__(name: str):
    if name in ("ShadowScheduler", "AsyncShadowScheduler"):
        from shadowprefill.integrations.vllm import scheduler
        return getattr(scheduler, name)
    if name == "ShadowStatLogger":
        from shadowprefill.integrations.vllm.metrics import ShadowStatLogger
        return ShadowStatLogger
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
