"""Shadow prefill inside vLLM: `ShadowScheduler` for `vllm serve --scheduler-cls
shadowprefill.integrations.vllm.ShadowScheduler --scheduling-policy priority --enable-prefix-caching`.

`ShadowScheduler` (scheduler.py) imports vLLM and is loaded on first access, so `config`, `shadow_kv`,
`stats` and `metrics` import without vLLM (and none of this needs the compiled extension).
"""
from shadowprefill.integrations.vllm.config import ENV_VAR, ShadowSchedulerConfig

__all__ = ["ENV_VAR", "ShadowSchedulerConfig", "ShadowScheduler", "ShadowStatLogger"]


def __getattr__(name: str):
    if name == "ShadowScheduler":
        from shadowprefill.integrations.vllm.scheduler import ShadowScheduler
        return ShadowScheduler
    if name == "ShadowStatLogger":
        from shadowprefill.integrations.vllm.metrics import ShadowStatLogger
        return ShadowStatLogger
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
