"""The manager's configuration (a JSON file for `shadowprefill serve-manager --config FILE`).

    {
      "host": "127.0.0.1", "port": 8000,
      "models": {                                   # manager model name -> instances
        "small": ["http://127.0.0.1:8001"],
        "large": [{"url": "http://127.0.0.1:8002", "served_model_name": "my-70b",
                   "kv_events": {"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558",
                                 "topic": "kv"}}, "http://10.0.0.7:8000"]
      },
      "router": {"type": "request"},                # or {"type": "markov", "p": 0.3, "seed": 0}
      "api_keys": {"sk-team-a": "team-a"},          # key -> tenant; empty/absent: no auth, tenant ""
      "shadow": {"enabled": true, "priority": 1000, "targets": "all", "min_switch_prob": 0.0,
                 "cost_ratio": 0.1, "poll_s": 0.05, "timeout_s": 120, "stream": false, "stream_tokens": 32},
      "connect_timeout_s": 2.0, "read_timeout_s": 300.0, "dead_retry_s": 5.0,
      "session_idle_s": 600.0,                      # a session idle this long has ended
      "tenant_cache_salt": null,                    # send cache_salt=<tenant>; null: on with > 1 tenant
      "gateway": {                                  # optional: "model": "auto" decided per call
        "models": {"small": {"quality": 0.7, "price_in": 0.1, "price_out": 0.4, "cached_price_ratio": 0.1},
                   "large": {"quality": 0.9, "price_in": 1.0, "price_out": 4.0}},
        "min_quality": 0.0, "max_latency_s": null, "lambda_latency": 1.0, "lambda_cost": 1.0,
        "stale_after_s": 2.0, "metrics_poll_s": 0.5
      }
    }

`kv_events` (per endpoint, optional): where the server publishes its KV-cache events (vLLM
`--kv-events-config`); the manager binds `endpoint` (vLLM connects to a non-wildcard address; set
`"bind": false` when the server binds `tcp://*:PORT`) and asks `replay_endpoint` for missed batches.
Without it the manager falls back to its own guess of what that server holds (`gateway.engine_view`).
Every section's keys are checked: a misspelt key is an error naming it.

`shadow.targets`: "all" (every other model's sticky instance) or "top1" (the other model most likely to
serve the session's next call, by the next-model prior `cluster.prior.SwitchPredictor`, learned online
from the routes of the manager's finished sessions, paper §3.1). `shadow.min_switch_prob`: the Predictive
gate (no shadow to a model less likely than this; 0 = off, the paper's Predictive policy uses 0.25).
`session_idle_s`: a session with no call for this long has ended (the prior learns its route, its state
is freed).
`shadow.cost_ratio`: the price of a second of shadow compute relative to a second of switch prefill saved
(κ of `ControlPlane.plan_shadows`, which decides where and whether each shadow goes).
`shadow.stream` (streamed shadows, paper §3.1): a session's shadow gets the call's prompt when the call
starts and grows every `shadow.stream_tokens` output tokens as the answer streams, each time as a
superseding request that resumes from the prefix the server cached (`serve.shadow_stream`); false: one
whole request after the call completes (appendix D.1), the default until the built-in server's shadow path
is checked with it; turn it on for vLLM servers (measured in docs/vllm-plugin.md).
`shadow.priority` is the lowest class the servers know: vLLM runs lower integers first, the built-in
server maps values >= its shadow threshold (default 1000) to shadow jobs.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Endpoint:
    model: str                  # the manager's model name
    url: str                    # base URL, e.g. http://127.0.0.1:8001
    served_model_name: str      # the `model` field the server expects
    kv_events: object = None    # gateway.kv_subscriber.EventSource, or None (no event stream)


def checked_kwargs(d, allowed, where: str) -> dict:
    """`d` as keyword arguments, after checking it is an object with only `allowed` keys (one-line error)."""
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise ValueError(f"{where} must be a JSON object, got {d!r}")
    unknown = set(d) - set(allowed)
    if unknown:
        raise ValueError(f"{where} has unknown keys {sorted(unknown)}")
    return dict(d)


@dataclass(frozen=True)
class ModelPrice:
    """A gateway candidate model: quality q_j and prices per token (paper 003 §III-A)."""

    quality: float = 1.0
    price_in: float = 1.0
    price_out: float = 1.0
    cached_price_ratio: float = 0.10

    def __post_init__(self) -> None:
        for name in ("quality", "price_in", "price_out", "cached_price_ratio"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0:
                raise ValueError(f"gateway.models.*.{name} must be a number >= 0, got {v!r}")
        if self.cached_price_ratio > 1:
            raise ValueError(f"gateway.models.*.cached_price_ratio must be in [0, 1], got {self.cached_price_ratio!r}")


@dataclass
class GatewayConfig:
    models: dict = field(default_factory=dict)          # model name -> ModelPrice
    min_quality: float = 0.0
    max_latency_s: float | None = None
    lambda_latency: float = 1.0
    lambda_cost: float = 1.0
    stale_after_s: float = 2.0
    metrics_poll_s: float = 0.5

    @classmethod
    def from_dict(cls, d, model_names) -> "GatewayConfig":
        kw = checked_kwargs(d, [f.name for f in cls.__dataclass_fields__.values()], "config.gateway")
        models = kw.pop("models", None) or {m: {} for m in model_names}
        if not isinstance(models, dict):
            raise ValueError(f"config.gateway.models must map model names to prices, got {models!r}")
        prices = {}
        for name, p in models.items():
            if name not in model_names:
                raise ValueError(f"config.gateway.models names {name!r}, not a model of config.models")
            prices[name] = ModelPrice(**checked_kwargs(p, ModelPrice.__dataclass_fields__,
                                                       f"config.gateway.models[{name!r}]"))
        for name in ("min_quality", "lambda_latency", "lambda_cost", "stale_after_s", "metrics_poll_s"):
            v = kw.get(name, 1.0)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0:
                raise ValueError(f"config.gateway.{name} must be a number >= 0, got {v!r}")
        v = kw.get("max_latency_s")
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
            raise ValueError(f"config.gateway.max_latency_s must be a number > 0 or null, got {v!r}")
        return cls(models=prices, **kw)


@dataclass
class ShadowConfig:
    enabled: bool = True
    priority: int = 1000
    targets: str = "all"
    min_switch_prob: float = 0.0
    cost_ratio: float = 0.1
    poll_s: float = 0.05
    timeout_s: float = 120.0
    stream: bool = False           # §3.1 streamed shadows (vLLM servers: turn on; see docs/vllm-plugin.md)
    stream_tokens: int = 32        # ... every this many output tokens (the servers' KV block size)

    def __post_init__(self) -> None:
        if self.targets not in ("all", "top1"):
            raise ValueError(f"shadow.targets must be 'all' or 'top1', got {self.targets!r}")
        p = self.min_switch_prob
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ValueError(f"shadow.min_switch_prob must be a number in [0, 1], got {p!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise TypeError(f"shadow.priority must be an int, got {self.priority!r}")
        k = self.cost_ratio
        if isinstance(k, bool) or not isinstance(k, (int, float)) or not k >= 0 or k == float("inf"):
            raise ValueError(f"shadow.cost_ratio must be a finite number >= 0, got {k!r}")
        for name in ("poll_s", "timeout_s"):
            if not isinstance(getattr(self, name), (int, float)) or getattr(self, name) <= 0:
                raise ValueError(f"shadow.{name} must be a number > 0, got {getattr(self, name)!r}")
        if not isinstance(self.stream, bool):
            raise TypeError(f"shadow.stream must be true or false, got {self.stream!r}")
        n = self.stream_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"shadow.stream_tokens must be an int >= 1, got {n!r}")


@dataclass
class ManagerConfig:
    models: dict[str, list[Endpoint]]
    router: dict = field(default_factory=lambda: {"type": "request"})
    api_keys: dict[str, str] = field(default_factory=dict)
    shadow: ShadowConfig = field(default_factory=ShadowConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 300.0
    dead_retry_s: float = 5.0
    session_idle_s: float = 600.0
    tenant_cache_salt: bool | None = None
    gateway: GatewayConfig | None = None

    def __post_init__(self) -> None:
        v = self.session_idle_s
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"config.session_idle_s must be a number > 0, got {v!r}")
        if self.tenant_cache_salt is None:                  # per-tenant prefix caches once tenants share servers
            self.tenant_cache_salt = len(set(self.api_keys.values())) > 1
        elif not isinstance(self.tenant_cache_salt, bool):
            raise ValueError(f"config.tenant_cache_salt must be true, false or null, got {self.tenant_cache_salt!r}")

    @classmethod
    def from_dict(cls, d: dict) -> "ManagerConfig":
        if not isinstance(d, dict):
            raise TypeError(f"config must be a JSON object, got {type(d).__name__}")
        unknown = set(d) - {"models", "router", "api_keys", "shadow", "host", "port", "connect_timeout_s",
                            "read_timeout_s", "dead_retry_s", "session_idle_s", "tenant_cache_salt", "gateway"}
        if unknown:
            raise ValueError(f"config has unknown keys {sorted(unknown)}")
        raw_models = d.get("models")
        if not isinstance(raw_models, dict) or not raw_models:
            raise ValueError("config.models must map model names to lists of endpoints")
        models: dict[str, list[Endpoint]] = {}
        for name, entries in raw_models.items():
            if not isinstance(entries, list) or not entries:
                raise ValueError(f"config.models[{name!r}] must be a non-empty list of endpoints")
            eps = []
            for e in entries:
                if isinstance(e, str):
                    e = {"url": e}
                if not isinstance(e, dict) or not isinstance(e.get("url"), str) or not e["url"].startswith("http"):
                    raise ValueError(f"config.models[{name!r}]: endpoint must be a URL or {{'url': ...}}, got {e!r}")
                checked_kwargs(e, ("url", "served_model_name", "kv_events"), f"config.models[{name!r}] endpoint")
                events = None
                if e.get("kv_events") is not None:
                    from shadowprefill.gateway.kv_subscriber import EventSource
                    events = EventSource.from_dict(e["kv_events"], f"config.models[{name!r}].kv_events")
                eps.append(Endpoint(name, e["url"].rstrip("/"), e.get("served_model_name", name), events))
            models[name] = eps
        api_keys = d.get("api_keys") or {}
        if not isinstance(api_keys, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in api_keys.items()):
            raise ValueError("config.api_keys must map API keys (str) to tenant names (str)")
        router = d.get("router") or {"type": "request"}
        checked_kwargs(router, ("type", "p", "seed"), "config.router")
        if not isinstance(router, dict) or router.get("type") not in ("request", "markov"):
            raise ValueError(f"config.router.type must be 'request' or 'markov', got {router!r}")
        shadow = ShadowConfig(**checked_kwargs(d.get("shadow"), ShadowConfig.__dataclass_fields__, "config.shadow"))
        gateway = None if d.get("gateway") is None else GatewayConfig.from_dict(d["gateway"], list(models))
        kwargs = {k: d[k] for k in ("host", "port", "connect_timeout_s", "read_timeout_s", "dead_retry_s",
                                    "session_idle_s", "tenant_cache_salt") if k in d}
        return cls(models=models, router=router, api_keys=dict(api_keys), shadow=shadow, gateway=gateway, **kwargs)

    @classmethod
    def from_file(cls, path: "str | Path") -> "ManagerConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))
