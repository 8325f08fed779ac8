"""Shadow-scheduler counters on vLLM's Prometheus `/metrics`, through vLLM's stat-logger plugin group.

vLLM's scheduler runs in the EngineCore process and reports `SchedulerStats` (a fixed dataclass: extra
fields do not survive the IPC to the API server), so the scheduler cannot put its own numbers on the stats
path. vLLM does load stat-logger plugins (entry-point group `vllm.stat_logger_plugins`, declared in this
project's pyproject.toml) into the API server, where `/metrics` lives; `ShadowStatLogger` is one. It tails
the scheduler's per-step JSON lines (`stats_path` of `SHADOWPREFILL_VLLM`, visible to both processes) and
keeps these counters and gauges, labelled with the served model name and engine index:

    shadowprefill:steps_total               steps executed by the ShadowScheduler
    shadowprefill:shadow_tokens_total       shadow tokens scheduled
    shadowprefill:budget_tokens_total       shadow tokens the controller allowed
    shadowprefill:shadow_chunks_total       shadow chunks scheduled
    shadowprefill:shadow_preempted_total    shadow requests preempted (KV or a waiting request)
    shadowprefill:shadow_evicted_blocks_total   shadow cache blocks evicted or recycled
    shadowprefill:shadow_promoted_blocks_total  shadow blocks hit by non-shadow requests
    shadowprefill:shadow_blocks             shadow KV blocks (held or cached) after the last step
    shadowprefill:tpot_slo_seconds          the TPOT SLO T the controller uses

Without `stats_path`, or when the served scheduler is not `ShadowScheduler`, the logger does nothing.
"""
from __future__ import annotations

import json
import os
import time

from shadowprefill.integrations.vllm.config import ShadowSchedulerConfig

try:                                        # vLLM's base class when vLLM is installed (it always is when loaded)
    from vllm.v1.metrics.loggers import StatLoggerBase as _Base
except ImportError:                         # pragma: no cover - documentation builds without vLLM
    _Base = object

SCHEDULER_CLS = "shadowprefill.integrations.vllm.ShadowScheduler"
_READ_EVERY_S = 0.25

_COUNTERS = {   # metric -> (stats field, cumulative in the file?)
    "shadowprefill:steps_total": ("step", True),
    "shadowprefill:shadow_tokens_total": ("shadow_tokens", False),
    "shadowprefill:budget_tokens_total": ("budget_tokens", False),
    "shadowprefill:shadow_chunks_total": ("shadow_chunks", False),
    "shadowprefill:shadow_preempted_total": ("shadow_preempted", True),
    "shadowprefill:shadow_evicted_blocks_total": ("shadow_evicted_blocks", True),
    "shadowprefill:shadow_promoted_blocks_total": ("shadow_promoted_blocks", True),
}
_GAUGES = {"shadowprefill:shadow_blocks": "shadow_blocks", "shadowprefill:tpot_slo_seconds": "tpot_slo_s"}
_DOC = {
    "shadowprefill:steps_total": "Steps executed by the ShadowScheduler.",
    "shadowprefill:shadow_tokens_total": "Shadow tokens scheduled.",
    "shadowprefill:budget_tokens_total": "Shadow tokens the controller allowed.",
    "shadowprefill:shadow_chunks_total": "Shadow chunks scheduled.",
    "shadowprefill:shadow_preempted_total": "Shadow requests preempted.",
    "shadowprefill:shadow_evicted_blocks_total": "Shadow cache blocks evicted or recycled.",
    "shadowprefill:shadow_promoted_blocks_total": "Shadow blocks hit by non-shadow requests.",
    "shadowprefill:shadow_blocks": "Shadow KV blocks held or cached after the last step.",
    "shadowprefill:tpot_slo_seconds": "TPOT SLO used by the shadow controller.",
}


class StatsTail:
    """Incremental reader of a JSON-lines file: new complete records since the last call."""

    def __init__(self, path: str) -> None:
        self.path, self._pos, self._partial = path, 0, b""

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self._pos:     # truncated or replaced: start over
                    self._pos, self._partial = 0, b""
                f.seek(self._pos)
                data = f.read()
                self._pos = f.tell()
        except FileNotFoundError:
            return []
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out


class ShadowStatLogger(_Base):
    """Per-engine vLLM stat logger exporting the shadow scheduler's counters (see the module docstring)."""

    def __init__(self, vllm_config, engine_index: int = 0) -> None:
        self.engine_index = engine_index
        self._tail = None
        self._last_read = 0.0
        cls = vllm_config.scheduler_config.scheduler_cls
        name = cls if isinstance(cls, str) else f"{getattr(cls, '__module__', '')}.{getattr(cls, '__name__', '')}"
        if name not in (SCHEDULER_CLS, "shadowprefill.integrations.vllm.scheduler.ShadowScheduler"):
            return
        path = ShadowSchedulerConfig.from_env().stats_path
        if path is None:
            return
        if vllm_config.parallel_config.data_parallel_size > 1:
            path = f"{path}.dp{engine_index}"
        from prometheus_client import Counter, Gauge
        labels = {"model_name": str(vllm_config.model_config.served_model_name), "engine": str(engine_index)}
        self._counters = {m: _registered(Counter, m, labels) for m in _COUNTERS}
        self._gauges = {m: _registered(Gauge, m, labels) for m in _GAUGES}
        self._last_cumulative = {m: 0 for m, (_, cum) in _COUNTERS.items() if cum}
        self._tail = StatsTail(os.path.expanduser(path))

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        if self._tail is None:
            return
        now = time.monotonic()
        if now - self._last_read < _READ_EVERY_S:
            return
        self._last_read = now
        self.update()

    def update(self) -> None:
        """Fold the records written since the last call into the counters."""
        records = self._tail.read() if self._tail is not None else []
        for rec in records:
            for metric, (field, cumulative) in _COUNTERS.items():
                value = rec.get(field)
                if not isinstance(value, (int, float)):
                    continue
                if cumulative:
                    inc = value - self._last_cumulative[metric]
                    self._last_cumulative[metric] = value
                    if inc > 0:
                        self._counters[metric].inc(inc)
                elif value > 0:
                    self._counters[metric].inc(value)
        if records:
            last = records[-1]
            for metric, field in _GAUGES.items():
                if isinstance(last.get(field), (int, float)):
                    self._gauges[metric].set(last[field])

    def log(self) -> None:
        if self._tail is not None:
            self.update()

    def log_engine_initialized(self) -> None:
        pass


_METRICS: dict[str, object] = {}


def _registered(kind, name: str, labels: dict):
    """A labelled child of a metric in prometheus_client's default registry (created once per process)."""
    metric = _METRICS.get(name)
    if metric is None:        # prometheus_client appends _total to counters itself
        metric = _METRICS[name] = kind(name.removesuffix("_total") if name in _COUNTERS else name, _DOC[name],
                                       labelnames=sorted(labels))
    return metric.labels(**labels)
