"""Cluster manager: M models x K instances, sticky per-step placement and shadow jobs (paper §3.1).

The manager sits between the per-step router and the engines. For every routed call it

1. places the call on the instance of the chosen model with the lowest estimated prefill completion time,
   counting only the tokens that instance does not cache (queue ahead + the call's uncached tail), so a
   switch call lands where its shadow is unless that instance is so busy that a cold prefill elsewhere
   finishes first ("Sticky model placement");
2. makes that instance the session's sticky instance of the model;
3. creates or extends the session's shadow job on the sticky instance of every other model, ordered by the
   next-model prior (or only the most likely one, `shadow_targets="top1"`), with the call's input at once,
   and appends the routed model's output tokens as they stream ("Incremental shadow jobs").

It owns no scheduler, pool or controller of its own: each instance is an `LLMEngine`; whoever drives time
(the discrete-event simulator, or a serving loop) steps the engines, hands their outputs to `on_outputs`,
and is told through `on_work(instance)` when an instance received new work.

Oracle (Table 2) is `oracle_warm`: the switch call's kept history is registered in the target instance's
prefix cache without computing it (pages allocated, committed and released), before the call is added.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence


class NextModelPrior(Protocol):
    """What the manager needs from a next-model predictor (e.g. cluster.router's prior)."""

    def probabilities(self, task: str, current_model: str, candidates: Sequence[str]) -> dict[str, float]:
        """P(next call goes to m | task, current model) for each candidate m != current model."""

    def observe_session(self, task: str, models: Sequence[str]) -> None:
        """Learn from the route of a finished session."""


ROLES = ("serve", "dedicated", "prefill", "decode")


class Instance:
    """One serving instance of one model: an `LLMEngine` plus its place in the cluster.

    `role`: "serve" (routed calls, normal traffic and harvested shadow work), "dedicated" (the Dedicated
    policy's extra instance: all shadow work of its model, routed calls, no normal traffic), or "prefill" /
    "decode" in a P/D-disaggregated cluster (`cluster.pd`).
    `latency_model` (optional) gives `host_transfer_time(tokens)` for placement estimates.
    """

    __slots__ = ("name", "model", "index", "engine", "latency_model", "role", "gpus", "iteration",
                 "busy_s", "busy_window_s")

    def __init__(self, name: str, model: str, index: int, engine, latency_model=None, role: str = "serve",
                 gpus: int = 1) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.name, self.model, self.index, self.engine = name, model, index, engine
        self.latency_model, self.role, self.gpus = latency_model, role, gpus
        self.iteration = None          # the driver's in-flight iteration (simulator bookkeeping)
        self.busy_s = 0.0
        self.busy_window_s = 0.0

    def __repr__(self) -> str:
        return f"Instance({self.name!r}, {self.role})"


@dataclass
class CallTicket:
    """A routed call in flight: where it runs, which shadow jobs its output streams into, and (once
    finished) its timings and token counts on the driver's clock."""

    request_id: str
    session_id: str
    call_index: int
    model: str
    instance: Instance
    is_switch: bool
    prompt_tokens: int
    request: object = None                      # the engine's Request (colocated: the whole call)
    stream_to: list = field(default_factory=list)   # instances holding this session's shadow jobs
    output: object = None                       # last RequestOutput seen
    oracle_warmed_tokens: int = 0
    arrival: float = math.nan
    first_token: float = math.nan
    finish: float = math.nan
    cached_tokens: int = 0                      # prompt tokens served from cache (device or host)
    host_cached_tokens: int = 0
    output_tokens: int = 0
    ttft_slo: float = math.inf
    tpot_slo: float = math.inf

    def fill_from(self, request) -> None:
        """Copy a finished engine Request's timings, cache hits and SLOs."""
        self.arrival, self.first_token, self.finish = (request.arrival_time, request.first_token_time,
                                                       request.finish_time)
        self.cached_tokens, self.host_cached_tokens = request.num_cached_tokens, request.num_host_cached_tokens
        self.output_tokens = len(request.output_token_ids)
        self.ttft_slo, self.tpot_slo = request.ttft_slo, request.tpot_slo


@dataclass
class _SessionState:
    tenant: str
    task: str
    current_model: str | None = None
    models: list = field(default_factory=list)          # route so far
    sticky: dict = field(default_factory=dict)          # model -> Instance
    shadow_on: set = field(default_factory=set)         # instances holding a shadow job of this session


class ClusterManager:
    """Per-step placement, sticky instances and shadow jobs over `instances[model] -> [Instance]`.

    `shadow_instances[model]`: where that model's shadow jobs run instead of the session's sticky instance
    (Dedicated). `shadows`: create shadow jobs at all (False for No Shadow / Host Tier / Oracle, though the
    engines would ignore them anyway). `oracle`: make every switch call's kept history cached for free.
    `prior`: a `NextModelPrior`; None gives every other model `default_switch_prob` (split evenly).
    """

    def __init__(self, instances: dict[str, list[Instance]], *, shadow_instances: dict[str, Instance] | None = None,
                 prior: NextModelPrior | None = None, shadow_targets: str = "all", shadows: bool = True,
                 oracle: bool = False, default_switch_prob: float = 0.5,
                 on_work: Callable[[Instance], None] | None = None) -> None:
        if not isinstance(instances, dict) or not instances:
            raise ValueError("instances must map each model to a non-empty list of Instance")
        for model, group in instances.items():
            if not group or not all(isinstance(i, Instance) and i.model == model for i in group):
                raise ValueError(f"instances[{model!r}] must be a non-empty list of that model's Instance")
        if shadow_targets not in ("all", "top1"):
            raise ValueError(f"shadow_targets must be 'all' or 'top1', got {shadow_targets!r}")
        if not 0.0 <= default_switch_prob <= 1.0:
            raise ValueError(f"default_switch_prob must be in [0, 1], got {default_switch_prob}")
        self.instances = instances
        self.models = list(instances)
        self.shadow_instances = dict(shadow_instances or {})
        for model, inst in self.shadow_instances.items():
            if model not in instances or not isinstance(inst, Instance):
                raise ValueError(f"shadow_instances[{model!r}] must be an Instance of a known model")
        self.prior = prior
        self.shadow_targets = shadow_targets
        self.shadows = shadows
        self.oracle = oracle
        self.default_switch_prob = default_switch_prob
        self.on_work = on_work
        self.sessions: dict[str, _SessionState] = {}
        self.tickets: dict[str, CallTicket] = {}
        self.oracle_tokens = 0
        self.shadow_jobs_created = 0
        self.finished_normal: list[tuple[str, float, float]] = []   # (request id, first token, finish)
        self.switch_calls = 0
        self.switch_calls_on_shadow = 0          # switch calls placed on the instance holding their shadow

    # ---------------------------------------------------------------------------------------- placement
    def estimate_prefill_s(self, inst: Instance, prompt: list[int], tenant: str = "",
                           assume_cached: int | None = None) -> float:
        """Estimated seconds until `prompt` finishes prefill on `inst` (the engine's estimate)."""
        return inst.engine.estimate_prefill_s(prompt, tenant, assume_cached)

    def place(self, session_id: str, model: str, prompt: list[int], tenant: str = "",
              assume_cached: int | None = None) -> Instance:
        """The instance of `model` with the lowest estimated prefill completion; ties go to the sticky one,
        then to the lowest index. A dedicated shadow instance is a candidate only for a session whose
        shadow it holds or that it already serves (it exists to run shadows, not as spare capacity)."""
        state = self.sessions.get(session_id)
        sticky = state.sticky.get(model) if state is not None else None
        best, best_t = None, math.inf
        for inst in self.instances[model]:
            if inst.role == "dedicated" and not (state is not None and (inst in state.shadow_on or inst is sticky)):
                continue
            t = self.estimate_prefill_s(inst, prompt, tenant, assume_cached)
            if t < best_t or (t == best_t and inst is sticky):
                best, best_t = inst, t
        return best

    def _shadow_home(self, state: _SessionState, session_id: str, model: str, prompt: list[int]) -> Instance:
        """Where the session's shadow of `model` runs: the dedicated instance, else the sticky one (chosen
        now, by the same estimate, if the session never used the model)."""
        dedicated = self.shadow_instances.get(model)
        if dedicated is not None:
            return dedicated
        inst = state.sticky.get(model)
        if inst is None:
            inst = state.sticky[model] = self.place(session_id, model, prompt, state.tenant)
        return inst

    # ------------------------------------------------------------------------------------------ calls
    def submit_call(self, session_id: str, call_index: int, model: str, prompt_token_ids, max_tokens: int, *,
                    task: str = "", tenant: str = "", kept_prefix: int | None = None,
                    output_token_ids=None) -> CallTicket:
        """Route call `call_index` of a session to `model` (the router's choice): place it, submit it as a
        routed request, and create/extend the session's shadow jobs on the other models (§3.1).
        `kept_prefix`: leading prompt tokens that are session history (what Oracle makes cached).
        `output_token_ids`: the call's recorded output, replayed by the engine (simulation)."""
        if model not in self.instances:
            raise ValueError(f"model {model!r} is not deployed; deployed: {self.models}")
        prompt = prompt_token_ids if isinstance(prompt_token_ids, list) else list(prompt_token_ids)
        state = self.sessions.get(session_id)
        if state is None:
            state = self.sessions[session_id] = _SessionState(tenant=tenant, task=task)
        is_switch = state.current_model is not None and state.current_model != model
        request_id = f"{session_id}#{call_index}"
        if request_id in self.tickets:
            raise ValueError(f"call {call_index} of session {session_id!r} is already in flight")

        warmed = 0
        if self.oracle and is_switch and kept_prefix:
            history = prompt[:kept_prefix]
            inst = self.place(session_id, model, prompt, state.tenant, assume_cached=len(history))
            warmed = self.oracle_warm(inst, history, state.tenant)
        else:
            inst = self.place(session_id, model, prompt, state.tenant)
        state.sticky[model] = inst
        if is_switch:
            self.switch_calls += 1
            self.switch_calls_on_shadow += inst in state.shadow_on
        for other in self.instances[model]:              # the model now serves the session itself
            if other in state.shadow_on:
                other.engine.cancel_shadow(session_id)
                state.shadow_on.discard(other)
        request = inst.engine.add_request(request_id, prompt, max_tokens, priority="routed", session_id=session_id,
                                          tenant=state.tenant, output_token_ids=output_token_ids)
        ticket = CallTicket(request_id, session_id, call_index, model, inst, is_switch, len(prompt), request,
                            oracle_warmed_tokens=warmed)
        self.tickets[request_id] = ticket
        state.current_model = model
        state.models.append(model)
        woken = [inst]
        if self.shadows:
            for target_model, p in self._shadow_targets(state, session_id, model):
                home = self._shadow_home(state, session_id, target_model, prompt)
                home.engine.add_shadow(session_id, prompt, switch_prob=p, tenant=state.tenant)
                state.shadow_on.add(home)
                ticket.stream_to.append(home)
                self.shadow_jobs_created += 1
                if home not in woken:
                    woken.append(home)
        if self.on_work is not None:
            for w in woken:
                self.on_work(w)
        return ticket

    def _shadow_targets(self, state: _SessionState, session_id: str, model: str) -> list[tuple[str, float]]:
        """Other models with their next-model probability, most likely first (top-1: only the first; the
        session's jobs on the others are dropped)."""
        others = [m for m in self.models if m != model]
        if not others:
            return []
        if self.prior is not None:
            probs = self.prior.probabilities(state.task, model, others)
        else:
            share = self.default_switch_prob / len(others)
            probs = {m: share for m in others}
        ranked = sorted(others, key=lambda m: (-probs.get(m, 0.0), self.models.index(m)))
        if self.shadow_targets == "top1":
            keep = ranked[0]
            for inst in list(state.shadow_on):
                if inst.model != keep and inst.model != model:
                    inst.engine.cancel_shadow(session_id)
                    state.shadow_on.discard(inst)
            ranked = ranked[:1]
        return [(m, min(1.0, max(0.0, float(probs.get(m, 0.0))))) for m in ranked]

    def on_outputs(self, inst: Instance, outputs) -> list[CallTicket]:
        """Take one step's outputs of `inst`: stream routed output tokens into the session's shadow jobs
        (§3.1 "output streaming"), and return the tickets of routed calls that finished. Finished normal
        requests are appended to `finished_normal` (the driver pops them)."""
        done: list[CallTicket] = []
        tickets = self.tickets
        fed: dict[int, Instance] = {}
        for out in outputs:
            ticket = tickets.get(out.request_id)
            if ticket is None:
                if out.finished:
                    self.finished_normal.append((out.request_id, out.first_token_time, out.finish_time))
                continue
            ticket.output = out
            self._stream_output(ticket, out, fed)
            if out.finished:
                del tickets[out.request_id]
                ticket.fill_from(ticket.request)
                done.append(ticket)
        if self.on_work is not None:
            for home in fed.values():
                self.on_work(home)
        return done

    @staticmethod
    def _stream_output(ticket: CallTicket, out, fed: dict) -> None:
        """§3.1 output streaming: append the call's new token to its shadow jobs on the other models
        (the instances fed are collected in `fed`, to be woken once per step)."""
        tok = out.new_token_id
        if tok is not None and ticket.stream_to:
            for home in ticket.stream_to:
                home.engine.extend_shadow(ticket.session_id, [tok])
                fed[id(home)] = home

    def end_session(self, session_id: str, cancel_shadows: bool = False) -> None:
        """The session's last call finished: teach the prior its route; optionally drop its shadow jobs
        (a real manager cannot know a session ended, so by default they run on, and count as waste)."""
        state = self.sessions.pop(session_id, None)
        if state is None:
            return
        if self.prior is not None and state.models:
            self.prior.observe_session(state.task, state.models)
        if cancel_shadows:
            for inst in state.shadow_on:
                inst.engine.cancel_shadow(session_id)

    # ------------------------------------------------------------------------------------------ normal
    def submit_normal(self, inst: Instance, request_id: str, prompt_token_ids, max_tokens: int):
        """Normal traffic for one instance; returns the engine's Request (its SLOs). When it finishes,
        (request id, first token time, finish time) lands in `finished_normal`."""
        request = inst.engine.add_request(request_id, prompt_token_ids, max_tokens, priority="normal")
        if self.on_work is not None:
            self.on_work(inst)
        return request

    # ------------------------------------------------------------------------------------------ oracle
    def oracle_warm(self, inst: Instance, history: list[int], tenant: str = "") -> int:
        """Oracle (Table 2): register `history`'s whole pages in `inst`'s prefix cache without computing
        them (`LLMEngine.import_prefix`). Returns the tokens resident afterwards."""
        resident, made = inst.engine.import_prefix(history, tenant)
        self.oracle_tokens += made
        return resident

    # ------------------------------------------------------------------------------------------ queries
    def all_instances(self) -> list[Instance]:
        seen, out = set(), []
        for group in self.instances.values():
            for inst in group:
                if id(inst) not in seen:
                    seen.add(id(inst))
                    out.append(inst)
        for inst in self.shadow_instances.values():
            if id(inst) not in seen:
                seen.add(id(inst))
                out.append(inst)
        return out
