"""The simulated deployment: run parameters (`SimConfig`), instance construction (an `LLMEngine` +
`SimulatedExecutor` over the model's roofline `LatencyModel`, sized from it, configured by a Table 2 policy
and the instance's role), and normal-traffic sources.

KV pool per instance: the HBM left after weights and an activation reserve (`LatencyModel.max_kv_tokens`),
in pages of `block_size` tokens; host tier (host-tier policies): `host_gb_per_gpu` x GPUs of DRAM, reloaded
over PCIe at the GPU's practical rate (`gpus.py`).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Iterator

from shadowprefill.cluster.manager import Instance
from shadowprefill.cluster.pd import PD_SHADOW_ITERATION_S
from shadowprefill.cluster.traces import normal_traffic, replay_trace
from shadowprefill.engine.clock import VirtualClock
from shadowprefill.engine.config import EngineConfig
from shadowprefill.engine.executor import SimulatedExecutor
from shadowprefill.engine.llm_engine import LLMEngine
from shadowprefill.model.latency import LatencyModel
from shadowprefill.sim.policies import DEDICATED_SHADOW_MODE, HOST_TIER_GB_PER_GPU, Policy


@dataclass
class SimConfig:
    """Cluster and measurement parameters of one simulated run (defaults: the paper's §5.1 / appendix B-C).

    `models`: the router's candidates (a pair or N > 2). `normal_rate`: normal requests/s per instance of
    each model (ρ × capacity, see `capacity.py`); 0 disables normal traffic. `tp`: per-model TP degree
    override (default: the paper's rule). `hbm_fraction`: share of the HBM used for weights + KV.
    `engine`: the engine and controller parameters every instance starts from (the engine's own defaults,
    the paper's values); `build_instance` fills in what depends on the model, the policy and the role
    (pool size, page bytes, shadow mode, host tier, idle cap, Predictive gate, model id).
    """

    models: tuple[str, ...]
    instances: int = 4
    normal_rate: dict = field(default_factory=dict)
    duration_s: float = 600.0
    warmup_s: float = 120.0
    max_drain_s: float = 3600.0
    seed: int = 0
    gpu: str = "h100"
    tp: dict = field(default_factory=dict)
    hbm_fraction: float = 0.9
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(num_blocks=1))
    host_gb_per_gpu: float = HOST_TIER_GB_PER_GPU
    pcie_bw: float | None = None
    shadow_targets: str = "all"
    dedicated_idle_cap_s: float = 1.0
    cancel_shadows_at_session_end: bool = False
    pd_prefill: int | None = None          # P/D: prefill instances per model (of `instances`); None = colocated
    link_bw_per_gpu: float = 50e9          # P/D: KV link bytes/s per GPU (assumed; Figure 16g sweeps 10-160 GB/s)
    push_tokens: int = 4096                # P/D: shadow KV push size (§3.5)

    def __post_init__(self) -> None:
        if not self.models or len(set(self.models)) != len(self.models):
            raise ValueError(f"models must be distinct model names, got {self.models!r}")
        if isinstance(self.instances, bool) or not isinstance(self.instances, int) or self.instances < 1:
            raise ValueError(f"instances must be an int >= 1, got {self.instances!r}")
        for name in ("duration_s", "warmup_s", "max_drain_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if self.pd_prefill is not None and not (isinstance(self.pd_prefill, int) and
                                                1 <= self.pd_prefill < self.instances):
            raise ValueError(f"pd_prefill must be an int in [1, instances), got {self.pd_prefill!r}")
        if not isinstance(self.engine, EngineConfig):
            raise TypeError(f"engine must be an EngineConfig, got {type(self.engine).__name__}")

    @classmethod
    def make(cls, **kwargs) -> "SimConfig":
        """A SimConfig from flat keyword arguments: EngineConfig field names (beta, n_min, token_budget, ...)
        go into `engine` (a sweep varies them by name), the rest are SimConfig fields."""
        engine_fields = {f for f in EngineConfig.__dataclass_fields__} - {"num_blocks"}
        engine = {k: kwargs.pop(k) for k in list(kwargs) if k in engine_fields}
        base = kwargs.pop("engine", None) or EngineConfig(num_blocks=1)
        return cls(engine=replace(base, **engine), **kwargs)

    def as_dict(self) -> dict:
        return asdict(self)


FILLER_TOKEN = 1   # the output token of requests that replay no recorded output (normal traffic)

NormalSource = Callable[[str, int, float, int], Iterator[tuple]]


def _stream_seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


def azure_normal_source(lengths: str = "conv", process: str = "poisson", records=None,
                        chunk_s: float = 300.0) -> NormalSource:
    """Normal traffic of one instance: `traces.normal_traffic` (Azure lengths, Poisson or gamma arrivals)
    generated lazily in chunks of `chunk_s`, or a replay of trace `records` rescaled to the instance's rate
    (each instance starts at its own offset into the trace). Deterministic in (seed, model, instance), so
    every policy of a seed sees the same requests. Yields (time, prompt_tokens, output_tokens, token_seed)."""

    def source(model: str, index: int, rate: float, seed: int) -> Iterator[tuple]:
        if records is not None:
            n = len(records)
            shift = (index * n) // 8 % n
            rotated = list(records[shift:]) + list(records[:shift])
            t0 = rotated[0].time_s
            span = records[-1].time_s - records[0].time_s
            rebased = [type(r)((r.time_s - t0) % (span + 1e-9), r.prompt_tokens, r.output_tokens) for r in rotated]
            rebased.sort(key=lambda r: r.time_s)
            chunk = 0
            while True:
                reqs = replay_trace(rebased, rate=rate, duration_s=chunk_s, start_s=chunk * chunk_s,
                                    seed=_stream_seed(seed, model, index, chunk))
                for r in reqs:
                    yield r.arrival_s, r.prompt_tokens, r.output_tokens, r.token_seed
                chunk += 1
        chunk = 0
        while True:
            reqs = normal_traffic(rate, chunk_s, seed=_stream_seed(seed, model, index, chunk), lengths=lengths,
                                  process=process, start_s=chunk * chunk_s)
            for r in reqs:
                yield r.arrival_s, r.prompt_tokens, r.output_tokens, r.token_seed
            chunk += 1

    return source


def build_instance(model: str, index: int, config: SimConfig, policy: Policy, clock: VirtualClock,
                   role: str = "serve", latency_cache: dict | None = None) -> Instance:
    """One engine of `model` sized by the latency model (KV pool from HBM left after weights)."""
    cache = latency_cache if latency_cache is not None else {}
    lm = cache.get(model)
    if lm is None:
        lm = cache[model] = LatencyModel(model, config.gpu, tp=config.tp.get(model), pcie_bw=config.pcie_bw)
    bs = config.engine.block_size
    num_blocks = max(1, lm.max_kv_tokens(config.hbm_fraction) // bs)
    page_bytes = int(round(lm.kv_bytes_per_token * bs))
    host_gib = config.host_gb_per_gpu * lm.tp * 1e9 / 2 ** 30 if policy.host_tier else 0.0
    mode = policy.shadow_mode
    idle_cap = None
    if role == "dedicated":
        mode, idle_cap = DEDICATED_SHADOW_MODE, config.dedicated_idle_cap_s
    elif policy.dedicated or role == "decode":
        mode = "none"
    elif role == "prefill":
        idle_cap = PD_SHADOW_ITERATION_S
    ecfg = replace(config.engine, num_blocks=num_blocks, shadow_mode=mode, host_tier_gib=host_gib,
                   page_bytes=page_bytes, idle_cap_s=idle_cap,
                   model_id=model)
    engine = LLMEngine(SimulatedExecutor(lm, filler_token=FILLER_TOKEN), ecfg, clock=clock)
    name = f"{model}/{ {'dedicated': 'x', 'prefill': 'p', 'decode': 'd'}.get(role, '')}{index}"
    return Instance(name, model, index, engine, lm, role=role, gpus=lm.tp)
