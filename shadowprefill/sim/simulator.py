"""Discrete-event simulator of a routed agent cluster (paper §4 "Serving simulator", §5.1).

Every instance is the project's `LLMEngine` with a `SimulatedExecutor` (no tensors; an iteration lasts what
the latency model says) on one shared `VirtualClock`: the same scheduler, KV pool, host tier and shadow
controller as a real run. A heap of timed events drives them:

- STEP    an instance's iteration ends: its `EngineDriver` applies it, the orchestration core takes its
          outputs (streams routed output into shadow jobs), finished calls / requests are recorded, and
          the next iteration starts if the instance has work (instances step only when they have work,
          each at its own pace);
- CALL    an agent session issues call k (its first call at the session's arrival; call k+1 after call k
          completes plus the tool gap); the core places it and creates/extends shadow jobs;
- NORMAL  a normal-traffic request arrives at one instance (Poisson or trace replay, per instance);
- WINDOW  start / end of the measurement window (stats snapshots);
- TIMER   a callback the core scheduled (P/D KV transfers and shadow pushes).

The run measures sessions that arrive in [warmup, warmup + duration) and drains until every one of them has
finished (normal traffic keeps arriving meanwhile), as in §5.1 "Measurement".
"""
from __future__ import annotations

import gc
import heapq
from typing import Iterator, Sequence

import numpy as np

from shadowprefill.cluster.manager import ClusterManager, Instance
from shadowprefill.cluster.pd import Disaggregation
from shadowprefill.cluster.warm_view import WarmView
from shadowprefill.cluster.workloads import Session, token_list
from shadowprefill.engine.clock import VirtualClock
from shadowprefill.sim.deployment import NormalSource, SimConfig, azure_normal_source, build_instance
from shadowprefill.sim.metrics import CallRecord, NormalRecord, RunResult
from shadowprefill.sim.policies import Policy, get_policy

_STEP, _CALL, _NORMAL, _WINDOW, _TIMER = 0, 1, 2, 3, 4


# PoolStats counters summed over the instances into RunResult.extra["pool"]
_POOL_TOTALS = ("shadow_blocks_allocated", "shadow_blocks_promoted", "shadow_blocks_wasted", "shadow_evictions",
                "normal_evictions", "spills", "reloads", "host_hit_tokens", "shadow_hit_tokens", "host_drops")


class Simulator:
    """One run of one policy over given sessions and normal traffic (build a new one per policy)."""

    def __init__(self, config: SimConfig, policy: "str | Policy", sessions: Sequence[Session], *,
                 normal_source: NormalSource | None = None, prior=None,
                 latency_cache: dict | None = None, call_router=None) -> None:
        if not isinstance(config, SimConfig):
            raise TypeError(f"config must be a SimConfig, got {type(config).__name__}")
        if call_router is not None and not callable(getattr(call_router, "route", None)):
            raise TypeError(f"call_router must be a cluster.router.Router (route(session, k, history, warm)), got "
                            f"{type(call_router).__name__}")
        self.call_router = call_router          # None: every call goes to its recorded model
        self.config = config
        self.policy = get_policy(policy)
        self.sessions = list(sessions)
        for s in self.sessions:
            bad = [m for m in s.models if m not in config.models]
            if bad:
                raise ValueError(f"session {s.session_id!r} routes to {bad[0]!r}, not among models {config.models}")
        self.clock = VirtualClock()

        cache = latency_cache if latency_cache is not None else {}
        common = dict(prior=prior, shadow_targets=config.shadow_targets, min_switch_prob=self.policy.min_switch_prob,
                      shadows=self.policy.shadows, oracle=self.policy.oracle, on_work=self._wake)
        instances: dict[str, list[Instance]] = {}
        if config.pd_prefill is not None:
            if self.policy.dedicated:
                raise ValueError("the Dedicated policy is not defined for a P/D-disaggregated cluster")
            decode: dict[str, list[Instance]] = {}
            for model in config.models:
                instances[model] = [build_instance(model, i, config, self.policy, self.clock,
                                                   role="prefill", latency_cache=cache)
                                    for i in range(config.pd_prefill)]
                decode[model] = [build_instance(model, i, config, self.policy, self.clock,
                                                role="decode", latency_cache=cache)
                                 for i in range(config.instances - config.pd_prefill)]
            kv = {m: cache[m].kv_bytes_per_token for m in config.models}
            pd = Disaggregation(decode, kv_bytes_per_token=kv, link_bw_per_gpu=config.link_bw_per_gpu,
                                push_tokens=config.push_tokens, schedule=lambda t, fn: self._push(t, _TIMER, fn))
            self.manager = ClusterManager(instances, disaggregation=pd, **common)
            decoders = pd.all_decoders()
        else:
            dedicated: dict[str, Instance] = {}
            for model in config.models:
                group = [build_instance(model, i, config, self.policy, self.clock, latency_cache=cache)
                         for i in range(config.instances)]
                if self.policy.dedicated:
                    d = build_instance(model, config.instances, config, self.policy, self.clock,
                                       role="dedicated", latency_cache=cache)
                    dedicated[model] = d
                    group.append(d)
                instances[model] = group
            self.manager = ClusterManager(instances, shadow_instances=dedicated, **common)
            decoders = []
        self.latency_models = cache
        self.instances = self.manager.all_instances() + decoders
        self._index = {id(inst): i for i, inst in enumerate(self.instances)}
        self._busy_window = [0.0] * len(self.instances)   # busy seconds inside the measurement window
        self.normal_source = normal_source if normal_source is not None else azure_normal_source()
        self._events: list = []
        self._seq = 0

    # ------------------------------------------------------------------------------------------- events
    def _push(self, t: float, kind: int, a, b=None) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, a, b))

    def _wake(self, inst: Instance) -> None:
        """Start an iteration on an idle instance that has work (the core's `on_work` callback)."""
        it = inst.driver.begin()
        if it is not None:
            self._push(it.start + it.duration, _STEP, self._index[id(inst)])

    # ---------------------------------------------------------------------------------------------- run
    def run(self, progress: bool | object = False) -> RunResult:
        """Simulate until every measured session and every normal request that arrived in the window has
        finished (or the drain limit passed); return the records."""
        # The run allocates millions of long-lived small objects (page keys, token lists): with the default
        # thresholds the cyclic collector rescans them over and over (10-15% of the run). Freeze what exists
        # and collect rarely; nothing here relies on prompt cycle collection. (No gc.collect() before the
        # freeze: it scanned the whole heap, ~0.1 s per run; garbage frozen now is collected after unfreeze.)
        gc.freeze()
        thresholds = gc.get_threshold()
        gc.set_threshold(50_000, 20, 20)
        try:
            return self._run(progress)
        finally:
            gc.set_threshold(*thresholds)
            gc.unfreeze()

    def _run(self, progress) -> RunResult:
        cfg = self.config
        w0, w1 = cfg.warmup_s, cfg.warmup_s + cfg.duration_s
        deadline = w1 + cfg.max_drain_s
        result = RunResult(policy=self.policy.name, window_s=cfg.duration_s)
        measured = {s.session_id for s in self.sessions if w0 <= s.arrival_s < w1}
        pending = set(measured)                  # measured sessions not finished yet
        result.sessions_measured = len(measured)
        histories: dict[str, np.ndarray] = {}
        by_id = {s.session_id: s for s in self.sessions}
        for s in self.sessions:
            if s.arrival_s < w1:
                self._push(s.arrival_s, _CALL, s.session_id, 0)
        # normal traffic: one stream per serving instance (a dedicated shadow instance gets none)
        streams: dict[int, Iterator] = {}
        for idx, inst in enumerate(self.instances):
            rate = cfg.normal_rate.get(inst.model, 0.0)
            if inst.role == "prefill":            # P/D: the same total normal load, entering at P instances
                rate *= cfg.instances / cfg.pd_prefill
            if inst.role in ("serve", "prefill") and rate > 0:
                streams[idx] = self.normal_source(inst.model, inst.index, rate, cfg.seed)
                self._push_normal(idx, streams[idx])
        normal_records: dict[str, NormalRecord] = {}
        normal_open: set[str] = set()            # measured normal requests not finished yet
        self._push(w0, _WINDOW, 0)
        self._push(w1, _WINDOW, 1)
        snaps: list[dict] = [{}, {}]
        bar = _progress(progress, w1)
        manager, clock, events, instances = self.manager, self.clock, self._events, self.instances
        normal_count = 0

        while events:
            t, _, kind, a, b = heapq.heappop(events)
            if t > deadline:
                break
            clock.advance_to(t)
            if bar is not None:
                bar = _advance(bar, t, w1, len(pending) + len(normal_open))
            if kind == _STEP:
                inst = instances[a]
                it = inst.driver.iteration
                outputs = inst.driver.end()
                start, end = (it.start if it.start > w0 else w0), (t if t < w1 else w1)
                if end > start:                                    # its part inside the window
                    self._busy_window[a] += end - start
                if outputs or manager.pd is not None:          # (P/D: prefill instances offer pushes)
                    for ticket in manager.on_outputs(inst, outputs):
                        self._finish_call(ticket, by_id[ticket.session_id], result, measured, pending, histories)
                done = manager.finished_normal
                if done:
                    for rid, first, finish in done:
                        if rid in normal_open:
                            normal_open.discard(rid)
                            rec = normal_records[rid]
                            rec.first_token, rec.finish = first, finish
                    done.clear()
                if t >= w1 and not pending and not normal_open:
                    break
                self._wake(inst)
            elif kind == _CALL:
                self._issue_call(by_id[a], b, histories)
            elif kind == _TIMER:
                a()
            elif kind == _NORMAL:
                inst = instances[a]
                _, plen, olen, token_seed = b
                normal_count += 1
                rid = f"n{a}-{normal_count}"
                prompt = token_list(token_seed, 0, 0, plen)         # (valid by construction: not re-checked)
                req = manager.submit_normal(inst, rid, prompt, olen)
                if w0 <= t < w1:
                    normal_records[rid] = NormalRecord(rid, inst.model, inst.name, t, plen, olen,
                                                       req.ttft_slo, req.tpot_slo)
                    normal_open.add(rid)
                if t < w1 or pending or normal_open:        # keep the load on while draining
                    self._push_normal(a, streams[a])
            else:
                snaps[a] = self._snapshot()
                if a == 1 and not pending and not normal_open:
                    break
        if bar is not None:
            bar.close()
        if not snaps[1]:                                    # stopped before the window closed
            snaps[1] = self._snapshot()
        self._fill_totals(result, snaps[0], snaps[1], clock.now())
        result.normal = list(normal_records.values())
        result.sessions_unfinished = len(pending)
        return result

    def _push_normal(self, idx: int, stream: Iterator) -> None:
        item = next(stream)
        self._push(item[0], _NORMAL, idx, item)

    def _snapshot(self) -> dict:
        snap = {}
        for idx, inst in enumerate(self.instances):
            st = inst.engine.stats
            snap[idx] = (st.prefill_tokens_routed + st.prefill_tokens_normal, st.shadow_tokens + st.eager_shadow_tokens)
        return snap

    # ---------------------------------------------------------------------------------------- sessions
    def _issue_call(self, session: Session, k: int, histories: dict) -> None:
        history = histories.get(session.session_id)
        kept = session.kept_prefix(k) if k else 0
        new = session.new_input_ids(k)
        prompt = np.concatenate([history[:kept], new]) if k else new
        output = session.output_ids(k)
        histories[session.session_id] = np.concatenate([prompt, output])
        prompt = prompt.tolist()
        model = session.calls[k].model
        if self.call_router is not None:        # per-call routing at issue time, on a read-only cache view
            state = self.manager.sessions.get((session.tenant, session.session_id))
            model = self.call_router.route(session, k, list(state.models) if state else [],
                                           WarmView(self.manager, session.session_id, prompt, session.tenant))
        self.manager.submit_call(session.session_id, k, model, prompt,
                                 session.calls[k].output_tokens, task=session.task, tenant=session.tenant,
                                 kept_prefix=kept, output_token_ids=output.tolist())

    def _finish_call(self, ticket, session: Session, result: RunResult, measured: set, pending: set,
                     histories: dict) -> None:
        t = ticket
        result.calls.append(CallRecord(
            session_id=t.session_id, call_index=t.call_index, task=session.task, model=t.model,
            instance=t.instance.name, is_switch=t.is_switch, arrival=t.arrival, first_token=t.first_token,
            finish=t.finish, prompt_tokens=t.prompt_tokens, cached_tokens=t.cached_tokens,
            host_cached_tokens=t.host_cached_tokens, output_tokens=t.output_tokens, ttft_slo=t.ttft_slo,
            tpot_slo=t.tpot_slo, measured=t.session_id in measured))
        k = ticket.call_index + 1
        if k < len(session.calls):
            self._push(self.clock.now() + session.calls[k].gap_s, _CALL, session.session_id, k)
        else:
            histories.pop(session.session_id, None)
            self.manager.end_session(session.session_id, session.tenant, self.config.cancel_shadows_at_session_end)
            pending.discard(session.session_id)

    # ------------------------------------------------------------------------------------------ totals
    def _fill_totals(self, result: RunResult, snap0: dict, snap1: dict, end: float) -> None:
        cfg = self.config
        window = cfg.duration_s
        energy = busy = 0.0
        prefill = shadow_window = shadow_total = used = gpus = 0
        tracked = self.policy.shadow_mode != "eager"
        for idx, inst in enumerate(self.instances):
            lm = self.latency_models[inst.model]
            b = min(self._busy_window[idx], window)
            energy += lm.energy_j(b, window - b)
            busy += b
            gpus += inst.gpus
            p0, s0 = snap0.get(idx, (0, 0))
            p1, s1 = snap1.get(idx, (p0, s0))
            prefill += p1 - p0
            shadow_window += s1 - s0
            st = inst.engine.stats
            shadow_total += st.shadow_tokens + st.eager_shadow_tokens
            used += inst.engine.kv_stats.shadow_tokens_used
        result.energy_j, result.busy_s, result.gpus = energy, busy, gpus
        result.prefill_tokens, result.shadow_tokens_window = prefill, shadow_window
        result.shadow_tokens, result.shadow_tokens_used = shadow_total, min(used, shadow_total)
        result.end_time = end
        branches: dict[str, int] = {}
        earned = spent = ratio_max = 0.0
        checked = over = 0
        for inst in self.instances:
            st = inst.engine.stats
            earned += st.credit_earned_s
            spent += st.credit_spent_s
            for k, v in st.budget_branches.items():
                branches[k] = branches.get(k, 0) + v
            checked += st.shadow_budget_iterations
            over += st.shadow_over_budget
            ratio_max = max(ratio_max, st.shadow_budget_ratio_max)
        result.extra.update(credit_earned_s=earned, credit_spent_s=spent, budget_branches=branches,
                            shadow_budget_iterations=checked, shadow_over_budget=over,
                            shadow_budget_ratio_max=ratio_max)
        pool = dict.fromkeys(_POOL_TOTALS, 0)       # where shadow pages went (bench/shadow_fate.py)
        for inst in self.instances:
            ks = inst.engine.kv_stats
            for k in _POOL_TOTALS:
                pool[k] += getattr(ks, k)
        pool["iterations"] = sum(inst.engine.stats.iterations for inst in self.instances)
        pool["shadow_chunks"] = sum(inst.engine.stats.shadow_chunks for inst in self.instances)
        result.extra["pool"] = pool
        result.extra.update(instances=len(self.instances), shadow_use_tracked=tracked,
                            oracle_tokens=self.manager.oracle_tokens,
                            shadow_jobs_created=self.manager.shadow_jobs_created,
                            switch_calls_on_shadow_instance=self.manager.switch_calls_on_shadow,
                            switch_calls_placed=self.manager.switch_calls)
        pd = self.manager.pd
        if pd is not None:
            links = pd.links.values()
            result.extra.update(shadow_pushed_tokens=pd.shadow_pushed_tokens,
                                shadow_pushes_lost=pd.shadow_push_lost,
                                link_bytes=sum(link.bytes_moved for link in links),
                                link_busy_s=sum(link.busy_s for link in links))


def _advance(bar, t: float, w1: float, open_calls: int):
    """Move the bar: simulated seconds up to the window's end `w1`, then the drain, counted as the calls and
    normal requests measured in the window that have finished since it ended."""
    if t < w1:
        if t >= bar.n + 1.0:
            bar.update(int(t) - bar.n)
        return bar
    drain = getattr(bar, "_drain_total", None)
    if drain is None:                                 # the window just ended: the drain phase starts
        bar.update(int(w1) - bar.n)
        bar.desc = f"{bar.desc} drain" if bar.desc else "drain"
        bar.bar_format = "{desc}: {bar}| {n:.0f}/{total:.0f} calls finished [{elapsed}<{remaining}]"
        bar.unit = "calls"
        bar.reset(total=open_calls)
        bar._drain_total = drain = open_calls
    done = drain - open_calls
    if done > bar.n:
        bar.update(done - bar.n)
        if not open_calls:
            bar.refresh()                             # the drain's end is always shown
    return bar


def _progress(progress, total: float):
    """A tqdm bar over simulated seconds (progress=True), a given bar, or None."""
    if progress is True:
        from tqdm import tqdm
        return tqdm(total=total, unit="sim s", bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} sim s "
                                                         "[{elapsed}<{remaining}]")
    return progress or None
