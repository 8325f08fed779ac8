"""The manager's live gateway (paper 003 in front of real servers): engine truth, tokens, decisions, learning.

- Engine truth: every endpoint with `kv_events` gets an `EngineView` on the one `CacheRegistry`, fed by a
  `KVEventSubscriber`; its `HttpInstance` then estimates cached tokens from the registry (`source:
  events`). An endpoint without events — or whose stream is stale (an event due after a call that
  computed new blocks did not come within `stale_after_s`) — uses the manager's own guess (`guess` /
  `stale` in `/manager/summary` and `/metrics`). A dead upstream's entries are dropped.
- Tokens: the request's token ids, else the upstream's `/tokenize` (one tokenizer per model: the first
  live instance), cached per (session, model); none (no `/tokenize`) -> the guess.
- Decisions: `"model": "auto"` -> `ControlPlane.decide` over every live (model, instance) with the
  config's quality and prices, the instance's queue from its `/metrics` (waiting requests x its mean call
  time) and the fitted prefill model; reuse / reprefill are executable (reuse of a prefix a shadow of this
  manager put there is reported as `shadow`); transfer / map / edge prefill have no execution path
  between separate servers and are listed infeasible. A named model is kept; its instance is the core's.
- Shadows: after a call completes, `plan_shadows` asks `ControlPlane.plan_shadows` where and whether
  to warm each likely next model (the prior's switch probability, the history's tokens, what each
  instance holds per its events or the guess, its fitted prefill time and waiting requests); the manager
  dispatches exactly the chosen ones. Down, stale or queue-metric-less instances are rejected with that
  reason.
- Learning: predicted vs reported cached tokens per call; seconds to first token feed `FittedPrefillModel`.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import logging
import math
import threading
import time
from collections import Counter
from dataclasses import asdict

from shadowprefill.gateway.control_plane import (Candidate, Constraints, ControlPlane, GatewayRequest,
                                                 ShadowCandidate, ShadowChoice)
from shadowprefill.gateway.engine_view import EngineView, registry_tenant
from shadowprefill.gateway.kv_subscriber import KVEventSubscriber
from shadowprefill.gateway.prefill_fit import FittedPrefillModel
from shadowprefill.gateway.registry import CacheRegistry
from shadowprefill.serve import prometheus as prom
from shadowprefill.serve.sessions import comparable

log = logging.getLogger(__name__)
NO_PATH = {"transfer": "no KV transfer path between separate servers (analytic only, gateway.transfer)",
           "map": "no cross-model KV mapper registered (analytic only)",
           "edge_prefill": "no edge site with a KV shipping path (analytic only)"}


class GatewayPrompt:
    """What the core places: the raw prompt, token ids per model (when known), the tenant, and an instance
    the gateway pinned (auto decisions)."""

    def __init__(self, raw, tenant: str, tokens: dict | None = None, pin=None) -> None:
        self.raw, self.tenant, self.tokens, self.pin = raw, tenant, dict(tokens or {}), pin

    def __len__(self) -> int:
        return len(self.raw) if hasattr(self.raw, "__len__") else 0


class LiveGateway:
    """Registry, event streams, tokenizer cache, per-call decisions and what they learned."""

    def __init__(self, config, instances: dict) -> None:
        self.config = config
        self.gw = config.gateway
        self.instances = instances
        self.registry, self.lock = CacheRegistry(), threading.RLock()
        self.fit = FittedPrefillModel()
        self.plane = ControlPlane(registry=self.registry, estimator=self.fit, overhead_s=0.0)
        tenants = set(config.api_keys.values())
        default_tenant = next(iter(tenants)) if len(tenants) == 1 and not config.tenant_cache_salt else ""
        self.subscriber: KVEventSubscriber | None = None
        for model, eps in config.models.items():
            for inst, ep in zip(instances[model], eps):
                inst.view = None
                inst.call_s = 0.1                   # EWMA of call seconds (queue estimate)
                inst.waiting = 0.0
                if ep.kv_events is None:
                    continue
                inst.view = EngineView(self.registry, self.lock, inst.url, model, default_tenant)
                if self.subscriber is None:
                    self.subscriber = KVEventSubscriber()
                self.subscriber.add(ep.kv_events, inst.view)
        self.decisions: list[dict] = []
        self.actions: Counter = Counter()
        self.abs_error_sum, self.error_count, self.within_block = 0.0, 0, 0
        self._tok_cache: dict = {}                  # (tenant, session, model) -> (prompt json, ids)
        self._poller: asyncio.Task | None = None
        self.client = None

    # ------------------------------------------------------------------------------------ lifecycle
    def start(self, client) -> None:
        self.client = client
        if self.subscriber is not None:
            self.subscriber.start()
        self._poller = asyncio.get_running_loop().create_task(self._poll_metrics())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            try:
                await self._poller
            except (asyncio.CancelledError, Exception):
                pass
        if self.subscriber is not None:
            self.subscriber.stop()

    def all(self):
        return [i for insts in self.instances.values() for i in insts]

    async def _poll_metrics(self) -> None:
        period = self.gw.metrics_poll_s if self.gw is not None else 0.5
        while True:
            for inst in self.all():
                try:
                    r = await self.client.get(inst.url + "/metrics", timeout=2.0)
                    inst.waiting = prom.metric_sum(prom.parse_metrics(r.text), prom.WAITING, default=math.nan)
                except (httpx.ConnectError, OSError) as exc:      # nothing listens: its cache is gone
                    inst.waiting = math.nan
                    inst.mark_down(f"metrics: {exc!r}", self.config.dead_retry_s)
                    self.dead(inst, f"metrics: {exc!r}")
                except Exception:  # noqa: BLE001 - slow or odd answer: queue unknown, cache kept
                    inst.waiting = math.nan
            await asyncio.sleep(max(period, 0.05))

    def dead(self, inst, error: str) -> None:
        """An upstream failed: its registry entries are dropped (its cache may be gone)."""
        if inst.view is not None:
            inst.view.clear()

    # ------------------------------------------------------------------------------------ sources
    def source(self, inst) -> str:
        if inst.view is None:
            return "guess"
        return "stale" if inst.view.stale() else "events"

    async def tokens(self, model: str, kind: str, prompt, session_key) -> list[int] | None:
        """Token ids of `prompt` for `model`: the request's own ids, else `/tokenize` on a live instance."""
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            return list(prompt)
        fields = {"messages": prompt, "add_generation_prompt": True} if kind == "chat" else {"prompt": prompt}
        return await self._tokenize(model, (session_key, model), prompt, fields)

    async def _tokenize(self, model: str, key, content, fields: dict) -> list[int] | None:
        """`/tokenize` on a live instance of `model` with the request `fields`, cached under `key` while the
        content is the same; None when no instance or tokenizer answers."""
        text = json.dumps(content, sort_keys=True)
        hit = self._tok_cache.get(key)
        if hit is not None and hit[0] == text:
            return hit[1]
        inst = next((i for i in self.instances[model] if i.alive), None)
        if inst is None or self.client is None:
            return None
        try:
            r = await self.client.post(inst.url + "/tokenize", json={"model": inst.served_model_name, **fields},
                                       timeout=5.0)
            ids = r.json().get("tokens") if r.status_code == 200 else None
        except Exception:  # noqa: BLE001 - no tokenizer: the guess answers
            ids = None
        if not isinstance(ids, list):
            return None
        if len(self._tok_cache) > 50_000:
            self._tok_cache.clear()
        self._tok_cache[key] = (text, ids)
        return ids

    def predicted_cached(self, inst, tenant: str, ids, prompt, session) -> tuple[int, str]:
        """(cached tokens the engine will report, source) for a call placed on `inst`."""
        src = self.source(inst)
        if src == "events" and ids is not None:
            bs = inst.view.block_size or 1
            cap = (len(ids) - 1) // bs * bs            # an engine recomputes at least the last prompt token
            return min(inst.view.cached_tokens(tenant, ids), max(cap, 0)), src
        n = len(ids) if ids is not None else None
        guess = inst.guess_cached(prompt, session)
        return int(guess if n is None else min(guess, n)), src

    # ------------------------------------------------------------------------------------ decisions
    def decide_auto(self, tenant: str, tokens: dict, headers, max_tokens: int):
        """The control plane's (model, instance, action) for an `auto` call; None when nothing is possible."""
        gw = self.gw
        min_q = _header_float(headers, "X-Gateway-Min-Quality", gw.min_quality)
        max_l = _header_float(headers, "X-Gateway-Max-Latency-S", gw.max_latency_s)
        cands, by_site = [], {}
        for model, price in gw.models.items():
            ids = tokens.get(model)
            if ids is None:
                continue
            for inst in self.instances[model]:
                if not inst.alive or self.source(inst) == "stale":
                    continue
                waiting = 0.0 if inst.waiting != inst.waiting else inst.waiting
                cands.append(Candidate(model, inst.url, price.quality, price.price_in, price.cached_price_ratio,
                                       queue_s=waiting * inst.call_s, output_price=price.price_out))
                by_site[inst.url] = inst
        if not cands:
            return None, None
        any_ids = next(iter(tokens.values()))
        req = GatewayRequest(registry_tenant(tenant), any_ids, output_tokens=max_tokens, tokens_by_model=tokens)
        cons = Constraints(max_latency_s=math.inf if max_l is None else max_l, min_quality=min_q,
                           lambda_latency=gw.lambda_latency, lambda_cost=gw.lambda_cost)
        with self.lock:
            decision = self.plane.decide(req, cands, cons, infeasible=NO_PATH)
        return decision, by_site

    async def history_tokens(self, model: str, body: dict, session_key) -> list[int] | None:
        """Token ids of a shadow body's history for `model`: its own ids, else `/tokenize` with its fields."""
        content = body.get("messages", body.get("prompt"))
        if "messages" not in body:
            return await self.tokens(model, "completion", content, (session_key, "shadow"))
        fields = {"messages": content,
                  **{k: body[k] for k in ("add_generation_prompt", "continue_final_message") if k in body}}
        return await self._tokenize(model, ((session_key, "shadow"), model), content, fields)

    def unavailable(self, inst) -> str:
        """Why `inst` cannot take a shadow now ('' when it can)."""
        if not inst.alive:
            return f"down: {inst.last_error}"
        if self.source(inst) == "stale":
            return "stale: its KV event stream went silent"
        if inst.waiting != inst.waiting:
            return "no queue metric (vllm:num_requests_waiting): a shadow would never be admitted"
        return ""

    async def plan_shadows(self, state, targets, body: dict, cost_ratio: float) -> list[ShadowChoice]:
        """The control plane's shadow dispatch for a completed call of `state`: `targets` are (model,
        switch probability) by the next-model prior, `body` the shadow request's body (the history)."""
        cands = []
        for model, p in targets:
            ids = await self.history_tokens(model, body, state.key)
            for inst in self.instances[model]:
                events = self.source(inst) == "events" and ids is not None
                if ids is not None:
                    history = ids
                else:
                    seq, per = comparable(body)
                    history = int(len(seq) / per)
                cands.append(ShadowCandidate(
                    model, inst.url, float(p), history,
                    block_size=(inst.view.block_size or 1) if events else 1,
                    waiting=0.0 if inst.waiting != inst.waiting else float(inst.waiting),
                    cached_tokens=None if events else int(inst.guess_cached(body, state)),
                    unavailable=self.unavailable(inst)))
        if not cands:
            return []
        with self.lock:
            return self.plane.plan_shadows(registry_tenant(state.tenant), cands, cost_ratio)

    def record(self, rec: dict) -> None:
        self.decisions.append(rec)
        self.actions[rec["action"]] += 1

    def entries_at(self, site: str) -> list:
        """Registry entries at one instance (a consistent copy)."""
        with self.lock:
            return [e for e in self.registry.entries() if e.location.site == site]

    def learn(self, rec: dict, reported: int | None, prompt_tokens: int | None, ttft_s: float | None,
              inst, started: float | None = None) -> None:
        """Compare prediction and report; feed the instance's prefill fit and call-time EWMA."""
        rec["reported_cached_tokens"] = reported
        if reported is not None:
            err = abs(rec["predicted_cached_tokens"] - reported)
            self.abs_error_sum += err
            self.error_count += 1
            bs = inst.view.block_size if inst.view is not None and inst.view.block_size else 16
            self.within_block += int(err <= bs)
            if inst.view is not None and prompt_tokens is not None and prompt_tokens - reported >= bs:
                inst.view.expect_event(self.gw.stale_after_s if self.gw else 2.0, since=started)
        if ttft_s is not None and prompt_tokens and reported is not None:
            self.fit.observe(inst.url, prompt_tokens, min(reported, prompt_tokens), ttft_s)
            inst.call_s = 0.8 * inst.call_s + 0.2 * ttft_s

    # ------------------------------------------------------------------------------------ reporting
    def status(self) -> dict:
        return {inst.url: {"source": self.source(inst), "fit": self.fit.coefficients(inst.url),
                           "events": None if inst.view is None else dict(inst.view.stats)} for inst in self.all()}

    def metrics_text(self) -> str:
        lines = ["# HELP shadowprefill_gateway_decisions_total Calls decided, by KV action.",
                 "# TYPE shadowprefill_gateway_decisions_total counter"]
        lines += [f'shadowprefill_gateway_decisions_total{{action="{a}"}} {float(n)}' for a, n in
                  sorted(self.actions.items())]
        lines += ["# HELP shadowprefill_gateway_cached_tokens_abs_error Predicted vs reported cached tokens.",
                  "# TYPE shadowprefill_gateway_cached_tokens_abs_error summary",
                  f"shadowprefill_gateway_cached_tokens_abs_error_sum {self.abs_error_sum}",
                  f"shadowprefill_gateway_cached_tokens_abs_error_count {float(self.error_count)}",
                  "# HELP shadowprefill_gateway_predictions_within_block_total Predictions within one block.",
                  "# TYPE shadowprefill_gateway_predictions_within_block_total counter",
                  f"shadowprefill_gateway_predictions_within_block_total {float(self.within_block)}",
                  "# HELP shadowprefill_gateway_registry_entries Cache registry entries.",
                  "# TYPE shadowprefill_gateway_registry_entries gauge",
                  f"shadowprefill_gateway_registry_entries {float(len(self.registry))}",
                  "# HELP shadowprefill_gateway_event_lag_seconds Age of the last applied event batch.",
                  "# TYPE shadowprefill_gateway_event_lag_seconds gauge"]
        lines += [f'shadowprefill_gateway_event_lag_seconds{{instance="{i.url}"}} {i.view.stats["lag_s"]}'
                  for i in self.all() if i.view is not None]
        stale = sum(self.source(i) == "stale" for i in self.all())
        lines += ["# HELP shadowprefill_gateway_stale_instances Instances whose event stream went silent.",
                  "# TYPE shadowprefill_gateway_stale_instances gauge",
                  f"shadowprefill_gateway_stale_instances {float(stale)}",
                  "# HELP shadowprefill_gateway_instance_source Where cache knowledge comes from (events, "
                  "guess: the server publishes no events, stale).",
                  "# TYPE shadowprefill_gateway_instance_source gauge"]
        lines += [f'shadowprefill_gateway_instance_source{{instance="{i.url}",source="{self.source(i)}"}} 1.0'
                  for i in self.all()]
        return "\n".join(lines) + "\n"


def _header_float(headers, name: str, default):
    v = headers.get(name)
    if v is None:
        return default
    try:
        x = float(v)
    except ValueError:
        raise ValueError(f"header {name} must be a number, got {v!r}") from None
    if x != x or x < 0:
        raise ValueError(f"header {name} must be a number >= 0, got {v!r}")
    return x


def option_dict(o) -> dict:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(o).items()}
