"""Global control plane: joint (model, site, KV action) choice per request (paper 003, §III-A, Fig. 4).

For every candidate (model j, site e) the plane enumerates the KV actions that are possible given the
registry's cache placement P_t, estimates latency L, cost C and quality Q = q_j − d for each, and returns

    argmin λ_L·L̃ + λ_C·C̃   s.t.  L <= L̄,  Q >= Q̄                                         (§III-A)

with L̃, C̃ = L, C divided by their largest value among the enumerated options. Actions:

* ``reuse``        exact prefix cached at the target site (device / host / remote tier of that site)
* ``shadow``       prefix warmed on the target by shadow prefill in harvested capacity (this project);
                   warm tokens = already warm + harvest rate × lead time; the tail is prefilled cold
* ``transfer``     target-model cache at another site: pack → (fp8) → send → unpack, Eq. 1
* ``map``          another model's cache through a registered mapper f_{i→j} with declared fidelity loss;
                   mapping overlaps the transfer (§VI-B): T = max(T_transfer, T_map)
* ``edge_prefill`` prefill on an edge site that hosts the model, ship the KV to the target (§III-C)
* ``reprefill``    full target-side prefill

After a call completes, :meth:`ControlPlane.plan_shadows` decides the shadow dispatch (where and
whether to warm the likely next models with the call's history; `gateway.shadow_plan`).

Cost is the token bill in units of c_miss: cached tokens at η·c_miss, prefilled tokens at c_miss; edge
prefill is billed at the edge site's prefill price instead, plus harvested compute and link egress at
their prices. Latencies come from a :class:`CostEstimator`:
the simulator's latency model when one is given, the Table III analytic model otherwise.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Protocol, Sequence, runtime_checkable

from .analytic import DEFAULT_PARAMS, AnalyticParams
from .registry import CacheLayout, CacheRegistry, PrefixHit
from .shadow_plan import ShadowCandidate, ShadowChoice, plan_shadows  # noqa: F401  (public here)
from .sites import Site, Topology
from .transfer import CODECS, codec_quality_loss

ACTIONS = ("reuse", "shadow", "transfer", "map", "edge_prefill", "reprefill")


@runtime_checkable
class CostEstimator(Protocol):
    """Latency source. ``kv_bytes_per_token(model)`` is optional (Table III's 15 KB/token otherwise)."""

    def prefill_time_s(self, model: str, tokens: int, cached_tokens: int = 0) -> float:
        """Seconds to prefill ``tokens`` context tokens of which the first ``cached_tokens`` are cached."""


class AnalyticCostModel:
    """Table III prefill model: T = a·(n−m) + b·(n²−m²) + τ for n tokens with m cached (so m=0 is §VI-B)."""

    def __init__(self, params: AnalyticParams = DEFAULT_PARAMS,
                 per_model: dict[str, AnalyticParams] | None = None):
        self.params = params
        self.per_model = dict(per_model or {})

    def _p(self, model: str) -> AnalyticParams:
        return self.per_model.get(model, self.params)

    def prefill_time_s(self, model: str, tokens: int, cached_tokens: int = 0) -> float:
        if tokens < 0 or not 0 <= cached_tokens <= tokens:
            raise ValueError(f"need 0 <= cached_tokens <= tokens, got {cached_tokens!r}, {tokens!r}")
        p = self._p(model)
        n, m = float(tokens), float(cached_tokens)
        return (p.a_prefill_ms * (n - m) + p.b_attn_ms * (n * n - m * m) + p.tau_prefill_ms) / 1e3

    def kv_bytes_per_token(self, model: str) -> float:
        return self._p(model).kv_bytes_per_token


class Mapper(Protocol):
    """Cross-model KV mapper f_{i→j} (§III-B). None is registered by default."""

    source_model: str
    target_model: str
    fidelity_loss: float  # ε_{i→j}, subtracted from the target's quality

    def time_s(self, tokens: int) -> float: ...


class MapperRegistry:
    def __init__(self):
        self._mappers: dict[tuple[str, str], Mapper] = {}

    def register(self, mapper: Mapper) -> None:
        for attr in ("source_model", "target_model", "fidelity_loss", "time_s"):
            if not hasattr(mapper, attr):
                raise TypeError(f"mapper lacks {attr!r}")
        if mapper.source_model == mapper.target_model:
            raise ValueError("mapper: source_model equals target_model")
        if not mapper.fidelity_loss >= 0:
            raise ValueError(f"mapper.fidelity_loss must be >= 0, got {mapper.fidelity_loss!r}")
        self._mappers[(mapper.source_model, mapper.target_model)] = mapper

    def for_target(self, target: str) -> list[Mapper]:
        return [m for (s, t), m in self._mappers.items() if t == target]


@dataclass(frozen=True)
class GatewayRequest:
    tenant: str
    tokens: Sequence[int]
    lead_time_s: float = 0.0  # time before this call's prefill must start (shadow work can warm meanwhile)
    now: float | None = None
    output_tokens: int = 0  # expected completion tokens (billed at each candidate's output_price)
    tokens_by_model: dict | None = None  # model -> its own token ids of the prompt (tokenizers differ)

    def tokens_for(self, model_id: str) -> Sequence[int]:
        """The prompt as `model_id` tokenizes it (``tokens`` unless ``tokens_by_model`` names the model)."""
        return (self.tokens_by_model or {}).get(model_id, self.tokens)

    def __post_init__(self):
        if not isinstance(self.tenant, str) or not self.tenant:
            raise ValueError(f"tenant must be a non-empty str, got {self.tenant!r}")
        if len(self.tokens) == 0:
            raise ValueError("tokens must not be empty")
        if self.lead_time_s < 0:
            raise ValueError(f"lead_time_s must be >= 0, got {self.lead_time_s!r}")


@dataclass(frozen=True)
class Candidate:
    """One (model, site) the request may run on, with what the plane needs to cost it."""

    model_id: str
    site: str
    quality: float = 1.0  # q_j(r)
    input_price: float = 1.0  # c_miss per token
    cached_price_ratio: float = 0.10  # η (Table III)
    queue_s: float = 0.0
    shadow_warm_tokens: int = 0  # prefix the model's shadow job already holds at this site
    harvest_tokens_per_s: float = 0.0  # shadow tokens/s the engine's harvested capacity sustains
    harvest_price_per_token: float = 0.0  # price of harvested compute (idle capacity: 0)
    layout: CacheLayout | None = None  # page layout of this model, for wire bytes
    output_price: float = 0.0  # per completion token, in the same unit as input_price

    def __post_init__(self):
        for f in ("model_id", "site"):
            if not isinstance(getattr(self, f), str) or not getattr(self, f):
                raise ValueError(f"{f} must be a non-empty str, got {getattr(self, f)!r}")
        for f in ("input_price", "queue_s", "shadow_warm_tokens", "harvest_tokens_per_s",
                  "harvest_price_per_token"):
            if getattr(self, f) < 0:
                raise ValueError(f"{f} must be >= 0, got {getattr(self, f)!r}")
        if not 0 <= self.cached_price_ratio <= 1:
            raise ValueError(f"cached_price_ratio must be in [0, 1], got {self.cached_price_ratio!r}")


@dataclass(frozen=True)
class Constraints:
    max_latency_s: float = math.inf  # L̄
    min_quality: float = -math.inf  # Q̄
    lambda_latency: float = 1.0  # λ_L
    lambda_cost: float = 1.0  # λ_C

    def __post_init__(self):
        if self.lambda_latency < 0 or self.lambda_cost < 0:
            raise ValueError("lambda_latency and lambda_cost must be >= 0")


@dataclass(frozen=True)
class Option:
    """One enumerated (model, site, action) with the estimates used to judge it."""

    model_id: str
    site: str
    action: str
    compression: str | None
    source: str | None  # where the KV comes from: site, "entry <id>", source model, edge site
    cached_tokens: int
    latency_s: float
    cost: float
    quality: float
    feasible: bool = True
    reason: str = ""
    score: float | None = None
    entry_id: int | None = None


@dataclass
class Decision:
    chosen: Option | None
    options: list[Option] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.chosen is not None

    def as_dict(self) -> dict:
        return {"chosen": None if self.chosen is None else asdict(self.chosen),
                "options": [asdict(o) for o in self.options]}


class ControlPlane:
    """Per-request joint decision over a registry, a topology, a cost estimator and optional mappers."""

    def __init__(self, topology: Topology | None = None, registry: CacheRegistry | None = None,
                 estimator: CostEstimator | None = None, mappers: MapperRegistry | None = None,
                 overhead_s: float = (DEFAULT_PARAMS.t_route_ms + DEFAULT_PARAMS.t_lookup_ms) / 1e3):
        if estimator is not None and not hasattr(estimator, "prefill_time_s"):
            raise TypeError("estimator must provide prefill_time_s(model, tokens, cached_tokens)")
        self.topology = topology
        self.registry = registry
        self.estimator = estimator if estimator is not None else AnalyticCostModel()
        self.mappers = mappers if mappers is not None else MapperRegistry()
        self.overhead_s = overhead_s  # t_route + t_lookup (Table III)

    # ---- helpers ----------------------------------------------------------------------------------
    def _site(self, name: str) -> Site:
        return self.topology.site(name) if self.topology is not None else Site(name)

    def _xfer_s(self, nbytes: float, src: str, dst: str) -> float:
        if src == dst:
            return 0.0
        if self.topology is None:
            return nbytes / DEFAULT_PARAMS.bandwidth_bytes_per_s  # Table III B, no topology given
        return self.topology.transfer_time_s(nbytes, src, dst)

    def _egress(self, nbytes: float, src: str, dst: str) -> float:
        if src == dst or self.topology is None:
            return 0.0
        link = self.topology.link(src, dst)
        return 0.0 if link is None else nbytes * link.price_per_byte

    def _prefill_s(self, c: Candidate, site: str, n: int, m: int) -> float:
        return self._prefill_at(c.model_id, site, n, m)

    def _prefill_at(self, model: str, site: str, n: int, m: int) -> float:
        at_site = getattr(self.estimator, "prefill_time_at", None)  # optional: a per-site (fitted) model
        if at_site is not None:
            return at_site(site, model, n, m)
        return self.estimator.prefill_time_s(model, n, m) / self._site(site).compute_scale

    def _bytes_per_token(self, c: Candidate, compression: str | None) -> float:
        if c.layout is not None:
            return CacheLayout(**{**asdict(c.layout), "compression": compression}).bytes_per_token
        per_token = getattr(self.estimator, "kv_bytes_per_token", None)  # optional in the protocol
        raw = DEFAULT_PARAMS.kv_bytes_per_token if per_token is None else per_token(c.model_id)
        return raw if compression is None else raw * CODECS[compression].element_bytes / 2.0  # vs bf16

    def _tier_read_s(self, hit: PrefixHit, nbytes: float) -> float:
        site = self._site(hit.entry.location.site)
        tier = hit.entry.location.tier
        if tier == "host":
            return nbytes / site.host_bandwidth_bytes_per_s
        if tier == "remote":
            return nbytes / site.remote_bandwidth_bytes_per_s
        return 0.0

    def _bill(self, c: Candidate, n: int, cached: int) -> float:
        return c.input_price * (cached * c.cached_price_ratio + (n - cached))

    # ---- enumeration ------------------------------------------------------------------------------
    def _options(self, req: GatewayRequest, c: Candidate, all_cands: Sequence[Candidate]) -> list[Option]:
        tokens = req.tokens_for(c.model_id)
        n, base = len(tokens), self.overhead_s + c.queue_s
        opts = [Option(c.model_id, c.site, "reprefill", None, None, 0,
                       base + self._prefill_s(c, c.site, n, 0), self._bill(c, n, 0), c.quality)]
        hits = [] if self.registry is None else self.registry.hits(req.tenant, c.model_id, tokens, req.now)
        local = [h for h in hits if h.entry.location.site == c.site]
        if local:  # reuse: longest prefix at the target site, fastest tier among equals
            h = min(local, key=lambda h: (-h.matched_tokens, self._tier_read_s(h, 1.0)))
            m = h.matched_tokens
            nbytes = m * h.entry.layout.bytes_per_token
            opts.append(Option(c.model_id, c.site, "reuse", h.entry.layout.compression,
                               f"entry {h.entry.entry_id}", m,
                               base + self._tier_read_s(h, nbytes) + self._prefill_s(c, c.site, n, m),
                               self._bill(c, n, m), c.quality - codec_quality_loss(h.entry.layout.compression),
                               entry_id=h.entry.entry_id))
        best_remote: dict[str, PrefixHit] = {}
        for h in hits:  # transfer: longest prefix per other site
            s = h.entry.location.site
            if s != c.site and (s not in best_remote or h.matched_tokens > best_remote[s].matched_tokens):
                best_remote[s] = h
        for s, h in best_remote.items():
            m, stored = h.matched_tokens, h.entry.layout.compression
            for codec in ([stored] if stored is not None else [None, *CODECS]):
                lay = CacheLayout(**{**asdict(h.entry.layout), "compression": codec})
                wire = m * lay.bytes_per_token
                lat = (base + self._tier_read_s(h, m * h.entry.layout.bytes_per_token)
                       + self._xfer_s(wire, s, c.site) + self._prefill_s(c, c.site, n, m))
                opts.append(Option(c.model_id, c.site, "transfer", codec, s, m, lat,
                                   self._bill(c, n, m) + self._egress(wire, s, c.site),
                                   c.quality - codec_quality_loss(codec), entry_id=h.entry.entry_id))
        harvested = int(c.harvest_tokens_per_s * req.lead_time_s)
        warm = min(n, c.shadow_warm_tokens + harvested)
        if warm > 0:  # shadow: warm prefix from harvested capacity, cold tail (never waits for the shadow)
            opts.append(Option(c.model_id, c.site, "shadow", None, "harvested capacity", warm,
                               base + self._prefill_s(c, c.site, n, warm),
                               self._bill(c, n, warm)
                               + c.input_price * c.harvest_price_per_token * max(0, warm - c.shadow_warm_tokens),
                               c.quality))
        for mapper in self.mappers.for_target(c.model_id):  # map: another model's cache through f_{i→j}
            src_hits = [] if self.registry is None else \
                self.registry.hits(req.tenant, mapper.source_model, req.tokens_for(mapper.source_model), req.now)
            if not src_hits:
                continue
            h = max(src_hits, key=lambda h: (h.matched_tokens, h.entry.location.site == c.site))
            m, s = h.matched_tokens, h.entry.location.site
            wire = m * h.entry.layout.bytes_per_token
            lat = base + max(self._xfer_s(wire, s, c.site), mapper.time_s(m)) + self._prefill_s(c, c.site, n, m)
            opts.append(Option(c.model_id, c.site, "map", h.entry.layout.compression, mapper.source_model, m,
                               lat, self._bill(c, n, m) + self._egress(wire, s, c.site),
                               c.quality - mapper.fidelity_loss
                               - codec_quality_loss(h.entry.layout.compression), entry_id=h.entry.entry_id))
        for edge in all_cands:  # edge prefill: an edge site hosting the same model prefills and ships
            if edge.model_id != c.model_id or edge.site == c.site or self._site(edge.site).kind != "edge":
                continue
            price = self._site(edge.site).prefill_price_per_token
            for codec in (None, *CODECS):
                wire = n * self._bytes_per_token(c, codec)
                lat = (self.overhead_s + edge.queue_s + self._prefill_s(c, edge.site, n, 0)
                       + self._xfer_s(wire, edge.site, c.site) + c.queue_s)
                cost = c.input_price * n * price + self._egress(wire, edge.site, c.site)
                opts.append(Option(c.model_id, c.site, "edge_prefill", codec, edge.site, n, lat, cost,
                                   c.quality - codec_quality_loss(codec)))
        return opts

    def decide(self, request: GatewayRequest, candidates: Sequence[Candidate],
               constraints: Constraints | None = None,
               infeasible: dict[str, str] | None = None) -> Decision:
        """Pick (model, site, action); returns every option with its estimates and why it was (not) taken.

        ``infeasible``: actions with no execution path here, each with its reason: their options are judged
        infeasible, and each is listed once even where it was not enumerated, so a decision shows what was
        not possible and why.
        """
        if not isinstance(request, GatewayRequest):
            raise TypeError(f"request must be GatewayRequest, got {type(request).__name__}")
        cands = list(candidates)
        if not cands or not all(isinstance(c, Candidate) for c in cands):
            raise ValueError("candidates must be a non-empty sequence of Candidate")
        cons = constraints if constraints is not None else Constraints()
        opts = [o for c in cands for o in self._options(request, c, cands)]
        if request.output_tokens:
            price = {(c.model_id, c.site): c.output_price for c in cands}
            opts = [replace(o, cost=o.cost + price[(o.model_id, o.site)] * request.output_tokens) for o in opts]
        finite = [o for o in opts if math.isfinite(o.latency_s)]
        l_ref = max((o.latency_s for o in finite), default=1.0) or 1.0
        c_ref = max((o.cost for o in finite), default=1.0) or 1.0
        judged = []
        for o in opts:
            why = []
            if not math.isfinite(o.latency_s):
                why.append("unreachable")
            elif o.latency_s > cons.max_latency_s:
                why.append(f"L={o.latency_s:.4g}s > L̄={cons.max_latency_s:.4g}s")
            if o.quality < cons.min_quality:
                why.append(f"Q={o.quality:.4g} < Q̄={cons.min_quality:.4g}")
            if infeasible and o.action in infeasible:
                why.append(infeasible[o.action])
            score = cons.lambda_latency * o.latency_s / l_ref + cons.lambda_cost * o.cost / c_ref \
                if math.isfinite(o.latency_s) else math.inf
            judged.append(Option(**{**asdict(o), "feasible": not why, "reason": "; ".join(why),
                                    "score": score}))
        if infeasible:
            listed = {o.action for o in judged}
            judged += [Option("*", "*", a, None, None, 0, math.inf, math.inf, -math.inf, False, why)
                       for a, why in infeasible.items() if a not in listed]
        feasible = [o for o in judged if o.feasible]
        chosen = min(feasible, key=lambda o: (o.score, o.latency_s, ACTIONS.index(o.action)), default=None)
        return Decision(chosen, judged)

    def commit(self, decision: Decision, request: GatewayRequest) -> None:
        """Record the use of the chosen cache entry (LRU / TTL / request-frequency statistics)."""
        o = decision.chosen
        if o is not None and o.entry_id is not None and self.registry is not None:
            if self.registry.get(o.entry_id) is not None:
                self.registry.touch(o.entry_id, request.now, site=o.site)

    def plan_shadows(self, tenant: str, candidates, cost_ratio: float = 0.1, now: float | None = None):
        """Where and whether to shadow a session's history (`gateway.shadow_plan.plan_shadows`)."""
        return plan_shadows(self, tenant, candidates, cost_ratio, now)
