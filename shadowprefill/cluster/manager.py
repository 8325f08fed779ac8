"""The orchestration core: sessions, sticky placement, next-model prior, shadow targets, output streaming
(paper §3.1; appendix D.1 for request-level backends).

One core serves every front end: the discrete-event simulator and the engine demo drive in-process
engines (`cluster.instance.Instance`), the HTTP manager drives OpenAI-compatible servers
(`serve.upstream.HttpInstance`); both are `InstanceHandle`s. For every routed call the core

1. places it on the healthy instance of the chosen model with the lowest estimated prefill completion
   time, counting only the tokens that instance does not cache (queue ahead + the call's uncached tail),
   so a switch call lands where its shadow is unless that instance is so busy that a cold prefill
   elsewhere finishes first ("Sticky model placement"; ties go to the sticky instance, then the lowest
   index);
2. makes that instance the session's sticky instance of the model, and drops the session's shadows on
   the model's instances (the model now serves the session itself);
3. picks shadow targets among the other models by the next-model prior (`cluster.targets`: all / top-1 /
   the Predictive gate) and gives each target's home (the session's sticky instance of that model, or the
   model's dedicated shadow instance) the session's history: incremental handles get the call's input at
   once and the routed model's output tokens as they stream ("Incremental shadow jobs", `on_outputs`);
   request-level handles get the completed call (`finish_call`, appendix D.1);
4. teaches the prior a session's route when the session ends.

A P/D-disaggregated cluster is this core plus `cluster.pd.Disaggregation` (decode placement, KV links,
shadow pushes): a call's prefill stage runs on a prefill instance, and the core continues it on a decode
instance through the same output handling.

Oracle (Table 2) is `oracle_warm`: the switch call's kept history is registered in the target instance's
prefix cache without computing it, before the call is added (in-process instances only).

Whoever drives time steps the engines (`cluster.driver.EngineDriver`), hands their outputs to
`on_outputs`, and is told through `on_work(instance)` when an instance received new work.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Callable

from shadowprefill.cluster.call_stats import CallTimes
from shadowprefill.cluster.instance import ROLES, Instance, InstanceHandle  # noqa: F401  (Instance: public here)
from shadowprefill.cluster.prior import NextModelPrior
from shadowprefill.cluster.session import SessionState
from shadowprefill.cluster.targets import ShadowTargets


class NoLiveInstance(RuntimeError):
    """No healthy instance of the routed model is left to place a call on."""


@dataclass
class CallTicket(CallTimes):
    """A routed call in flight: where it runs, which shadows its output streams into, and (once finished)
    its timings and token counts on the driver's clock (in-process backends)."""

    request_id: str
    session_id: str | None
    call_index: int
    model: str
    instance: object
    is_switch: bool
    prompt_tokens: int
    prompt: object = None                       # what the backend submits (token ids, or the HTTP prompt)
    payload: object = None                      # backend extras (HTTP: path, body, headers)
    session: SessionState | None = None
    max_tokens: int = 0                         # output tokens of the whole call
    stage_max_tokens: int = 0                   # ... of the stage running now (P/D: 1 on the prefill side)
    stage: int = 0                              # 0: the first stage; 1: P/D decode stage
    request: object = None                      # the backend's request of the first stage
    replay: list | None = None                  # recorded output the engine replays (simulation), else None
    stream_to: list = field(default_factory=list)   # incremental homes of this session's shadows
    deferred: list = field(default_factory=list)    # (model, probability) for request-level homes
    tried: list = field(default_factory=list)       # instances this call was submitted to (fail-over)
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


class ClusterManager:
    """The orchestration core over `instances[model] -> [InstanceHandle]` (module docstring).

    `shadow_instances[model]`: where that model's shadows run instead of the session's sticky instance
    (Dedicated). `shadows`: give shadows at all (False for No Shadow / Host Tier / Oracle). `prior`: a
    `NextModelPrior`; None gives every other model `default_switch_prob` (split evenly). `shadow_targets`
    ("all" | "top1") and `min_switch_prob` (the Predictive gate): `cluster.targets`. `oracle`: make every
    switch call's kept history cached for free. `disaggregation`: a `cluster.pd.Disaggregation` (P/D).
    """

    def __init__(self, instances: dict[str, list], *, shadow_instances: dict | None = None,
                 prior: NextModelPrior | None = None, shadow_targets: str = "all", min_switch_prob: float = 0.0,
                 shadows: bool = True, oracle: bool = False, default_switch_prob: float = 0.5,
                 on_work: Callable | None = None, disaggregation=None) -> None:
        if not isinstance(instances, dict) or not instances:
            raise ValueError("instances must map each model to a non-empty list of instances")
        for model, group in instances.items():
            if not group or not all(getattr(i, "model", None) == model and callable(getattr(i, "submit_call", None))
                                    for i in group):
                raise ValueError(f"instances[{model!r}] must be a non-empty list of that model's instances")
        self.instances = instances
        self.models = list(instances)
        self.shadow_instances = dict(shadow_instances or {})
        for model, inst in self.shadow_instances.items():
            if model not in instances or getattr(inst, "model", None) != model:
                raise ValueError(f"shadow_instances[{model!r}] must be an instance of a known model")
        self.targets = ShadowTargets(shadow_targets, min_switch_prob, default_switch_prob)
        self.prior = prior
        self.shadows = shadows
        self.oracle = oracle
        self.on_work = on_work
        self.pd = disaggregation
        self.sessions: dict[tuple[str, str], SessionState] = {}
        self.tickets: dict[str, CallTicket] = {}
        self.finished_normal: list[tuple[str, float, float]] = []   # (request id, first token, finish)
        self.oracle_tokens = 0
        self.shadow_jobs_created = 0
        self.switch_calls = 0
        self.switch_calls_on_shadow = 0          # switch calls placed on the instance holding their shadow
        self._stateless = itertools.count()
        self._normal_rest: dict[str, tuple] = {}     # P/D: normal request id on P -> (Request, output tokens)
        self._normal_first: dict[str, tuple] = {}    # P/D: normal request id on D -> (original id, first token)
        if disaggregation is not None:
            disaggregation.check(self)

    @property
    def shadow_targets(self) -> str:
        return self.targets.mode

    # ------------------------------------------------------------------------------------- sessions
    def session(self, session_id: str, tenant: str = "", task: str = "", shadow_enabled: bool = True) -> SessionState:
        """The session's state, created on first use (with `task` and `shadow_enabled`)."""
        key = (tenant, session_id)
        state = self.sessions.get(key)
        if state is None:
            if not isinstance(session_id, str) or not session_id:
                raise ValueError(f"session_id must be a non-empty str, got {session_id!r}")
            state = self.sessions[key] = SessionState(session_id, tenant, task, shadow_enabled)
        return state

    def end_session(self, session_id: str, tenant: str = "", cancel_shadows: bool = False) -> None:
        """The session ended: teach the prior its route; optionally drop its shadows (a real manager cannot
        know a session ended, so by default they run on, and count as waste)."""
        state = self.sessions.pop((tenant, session_id), None)
        if state is None:
            return
        if self.prior is not None and state.models:
            self.prior.observe_session(state.task, state.models)
        if cancel_shadows:
            for inst in state.shadow_on:
                inst.cancel_shadow(state)

    # ------------------------------------------------------------------------------------ placement
    def estimate_prefill_s(self, inst, prompt, tenant: str = "", assume_cached: int | None = None,
                           session_id: str = "-") -> float:
        """Estimated seconds until `prompt` finishes prefill on `inst` (the instance's estimate)."""
        state = self.sessions.get((tenant, session_id)) or SessionState(session_id, tenant)
        return inst.estimate_prefill_s(prompt, state, assume_cached)

    def place(self, session_id: str | None, model: str, prompt, tenant: str = "", assume_cached: int | None = None,
              exclude=()):
        """The healthy instance of `model` (not in `exclude`) with the lowest estimated prefill completion;
        ties go to the sticky one, then to the lowest index; None if none is healthy. A dedicated shadow
        instance is a candidate only for a session whose shadow it holds or that it already serves (it
        exists to run shadows, not as spare capacity)."""
        if model not in self.instances:
            raise ValueError(f"model {model!r} is not deployed; deployed: {self.models}")
        state = self.sessions.get((tenant, session_id)) if session_id is not None else None
        return self._place(state if state is not None else SessionState(session_id or "-", tenant), model,
                           prompt, assume_cached, exclude)

    def _place(self, state: SessionState, model: str, prompt, assume_cached=None, exclude=()):
        sticky = state.sticky.get(model)
        best, best_t = None, math.inf
        for inst in self.instances[model]:
            if inst.role == "dedicated" and not (inst in state.shadow_on or inst is sticky):
                continue
            if inst in exclude or not inst.healthy():
                continue
            t = inst.estimate_prefill_s(prompt, state, assume_cached)
            if t < best_t or (t == best_t and inst is sticky) or best is None:
                best, best_t = inst, t
        return best

    def _shadow_home(self, state: SessionState, model: str, prompt):
        """Where the session's shadow of `model` runs: the dedicated instance, else the sticky one (chosen
        now, by the same estimate, if the session never used the model or its sticky one is down)."""
        dedicated = self.shadow_instances.get(model)
        if dedicated is not None:
            return dedicated
        inst = state.sticky.get(model)
        if inst is None or not inst.healthy():
            inst = self._place(state, model, prompt)
            if inst is not None:
                state.sticky[model] = inst
        return inst

    # ---------------------------------------------------------------------------------------- calls
    def submit_call(self, session_id: str | None, call_index: int | None, model: str, prompt, max_tokens: int = 0,
                    *, task: str = "", tenant: str = "", kept_prefix: int | None = None, payload=None,
                    output_token_ids=None) -> CallTicket:
        """Route call `call_index` of a session to `model` (the router's choice): place it, submit it, and
        create / extend the session's shadows on the other models (§3.1). `session_id` None: a stateless
        call (no stickiness, no shadows). `kept_prefix`: leading prompt tokens that are session history
        (what Oracle makes cached). `payload`: backend extras (HTTP: path, body, headers).
        `output_token_ids`: the call's recorded output, replayed by in-process engines (simulation).
        Raises NoLiveInstance when no instance of `model` is healthy."""
        if model not in self.instances:
            raise ValueError(f"model {model!r} is not deployed; deployed: {self.models}")
        if session_id is None:
            state, request_id = None, f"-#{next(self._stateless)}"
            call_index = 0
        else:
            state = self.session(session_id, tenant, task)
            if call_index is None:
                call_index = state.num_calls
            request_id = f"{session_id}#{call_index}"
            if request_id in self.tickets:
                raise ValueError(f"call {call_index} of session {session_id!r} is already in flight")
        placing = state if state is not None else SessionState("-", tenant)
        is_switch = state is not None and state.current_model is not None and state.current_model != model
        warmed = 0
        if self.oracle and is_switch and kept_prefix:
            history = prompt[:kept_prefix]
            inst = self._place(placing, model, prompt, assume_cached=len(history))
            if inst is not None:
                warmed = self.oracle_warm(inst, history, tenant)
        else:
            inst = self._place(placing, model, prompt)
        if inst is None:
            raise NoLiveInstance(f"model {model!r} is unavailable: no healthy instance")
        ticket = CallTicket(request_id, session_id, call_index, model, inst, is_switch,
                            len(prompt) if hasattr(prompt, "__len__") else 0, prompt, payload, state, max_tokens,
                            1 if self.pd is not None else max_tokens, oracle_warmed_tokens=warmed,
                            replay=None if output_token_ids is None else list(output_token_ids))
        if is_switch:
            self.switch_calls += 1
            self.switch_calls_on_shadow += inst in state.shadow_on
        self._start(ticket, inst)
        self.tickets[request_id] = ticket
        woken = [inst]
        if state is not None:
            state.models.append(model)
            if self.shadows and state.shadow_enabled:
                self._give_shadows(ticket, state, model, prompt, woken)
        if self.on_work is not None:
            for w in woken:
                self.on_work(w)
        if self.pd is not None and self.oracle and is_switch and kept_prefix:
            self.oracle_tokens += self.pd.oracle_warm(session_id, model, prompt[:kept_prefix], tenant)
        return ticket

    def _start(self, ticket: CallTicket, inst) -> None:
        """Submit the call to `inst`, its session's sticky instance of the model from now on."""
        state = ticket.session
        if state is not None:
            state.sticky[ticket.model] = inst
            for other in self.instances[ticket.model]:       # the model now serves the session itself
                if other in state.shadow_on:
                    other.cancel_shadow(state)
                    state.shadow_on.discard(other)
        ticket.instance = inst
        ticket.tried.append(inst)
        ticket.request = inst.submit_call(ticket)

    def _give_shadows(self, ticket: CallTicket, state: SessionState, model: str, prompt, woken: list) -> None:
        targets = self.targets.choose(self.prior, state.task, model, self.models)
        keep = {m for m, _ in targets}
        for inst in list(state.shadow_on):                # top-1 / gate: shadows of other models are dropped
            if inst.model != model and inst.model not in keep:
                inst.cancel_shadow(state)
                state.shadow_on.discard(inst)
        for target, p in targets:
            if not (self.shadow_instances.get(target) or self.instances[target][0]).incremental:
                ticket.deferred.append((target, p))       # request-level: the completed call (finish_call)
                continue
            home = self._shadow_home(state, target, prompt)
            if home is None:
                continue
            home.upsert_shadow(state, prompt, p)
            state.shadow_on.add(home)
            ticket.stream_to.append(home)
            self.shadow_jobs_created += 1
            if home not in woken:
                woken.append(home)

    def fail_over(self, ticket: CallTicket) -> bool:
        """The call's instance failed before answering: resubmit it, cold, to the best other healthy
        instance of its model. False if none is left."""
        state = ticket.session if ticket.session is not None else SessionState("-", "")
        inst = self._place(state, ticket.model, ticket.prompt, exclude=ticket.tried)
        if inst is None:
            return False
        self._start(ticket, inst)
        return True

    def finish_call(self, ticket: CallTicket, history=None) -> None:
        """A front end that reads the answer itself (HTTP) reports a call done. `history`: what the
        session's request-level shadow homes should now hold (None: the call failed, no shadow)."""
        self.tickets.pop(ticket.request_id, None)
        state = ticket.session
        if state is None or history is None:
            return
        for target, p in ticket.deferred:
            home = self._shadow_home(state, target, ticket.prompt)
            if home is None:
                continue
            home.upsert_shadow(state, history, p)
            state.shadow_on.add(home)
            self.shadow_jobs_created += 1

    # --------------------------------------------------------------------------- in-process outputs
    def on_outputs(self, inst, outputs) -> list[CallTicket]:
        """Take one iteration's outputs of an in-process `inst`: stream routed output tokens into the
        session's shadows (§3.1 "output streaming"; the homes fed are woken once), continue a P/D call on
        its decode instance, and return the tickets of calls that finished. Finished normal requests are
        appended to `finished_normal` (the driver pops them)."""
        done: list[CallTicket] = []
        tickets = self.tickets
        fed: dict[int, object] = {}
        for out in outputs:
            ticket = tickets.get(out.request_id)
            if ticket is None:
                if out.finished:
                    self._normal_finished(inst, out)
                continue
            ticket.output = out
            tok = out.new_token_id
            if tok is not None and ticket.stream_to:
                session = ticket.session
                for home in ticket.stream_to:
                    home.extend_shadow(session, [tok])
                    fed[id(home)] = home
            if out.finished:
                del tickets[out.request_id]
                if ticket.stage == 0:
                    ticket.fill_from(ticket.request)   # arrival, first token, cache hits, SLOs
                else:
                    ticket.finish = out.finish_time
                    ticket.output_tokens += out.num_output_tokens
                if ticket.output_tokens < ticket.max_tokens and self.pd is not None and ticket.stage == 0:
                    self._decode_stage(inst, out.request_id, ticket.request.all_token_ids, ticket, ticket.max_tokens,
                                       ticket.session.tenant if ticket.session is not None else "",
                                       out.first_token_time)
                else:
                    done.append(ticket)
        if fed and self.on_work is not None:
            for home in fed.values():
                self.on_work(home)
        if self.pd is not None and inst.role == "prefill":
            self.pd.offer_pushes(inst)
        return done

    def submit_normal(self, inst, request_id: str, prompt_token_ids, max_tokens: int):
        """Normal traffic for one in-process instance; returns the engine's Request (its SLOs). When it
        finishes, (request id, first token time, finish time) lands in `finished_normal`. P/D: it is
        prefilled here and decoded on the least-loaded decode instance. Only its final output is reported
        (it is submitted with stream=False)."""
        if self.pd is None:
            request = inst.submit_request(request_id, prompt_token_ids, max_tokens, priority="normal", stream=False)
        else:
            request = inst.submit_request(request_id, prompt_token_ids, 1, priority="normal", stream=False)
            self._normal_rest[request_id] = (request, max_tokens)
        if self.on_work is not None:
            self.on_work(inst)
        return request

    def _normal_finished(self, inst, out) -> None:
        rid = out.request_id
        if self.pd is None:
            self.finished_normal.append((rid, out.first_token_time, out.finish_time))
            return
        rest = self._normal_rest.pop(rid, None)
        if rest is not None:                                     # prefill stage done
            request, total = rest
            if total <= 1:
                self.finished_normal.append((rid, out.first_token_time, out.finish_time))
            else:
                self._decode_stage(inst, rid, request.all_token_ids, None, total, "", out.first_token_time)
            return
        first = self._normal_first.pop(rid, None)
        if first is not None:                                    # decode stage done
            self.finished_normal.append((first[0], first[1], out.finish_time))

    def _decode_stage(self, p_inst, rid: str, tokens, ticket: CallTicket | None, total: int, tenant: str,
                      first_token: float) -> None:
        """P/D: move the prompt's KV (and first token) to the decode instance, then decode the rest there."""
        pd = self.pd
        session = ticket.session_id if ticket is not None else None
        d = pd.decode_for(session, p_inst.model)
        d_rid = rid + "@d"
        if ticket is not None:
            self.tickets[d_rid] = ticket
            ticket.stage, ticket.instance = 1, d
            pd.context_moved(d, session)
        else:
            self._normal_first[d_rid] = (rid, first_token)
        tokens = list(tokens)

        replay = ticket.replay[1:] if ticket is not None and ticket.replay is not None else None   # after P's token

        def start() -> None:
            d.submit_request(d_rid, tokens, total - 1, priority="routed" if ticket else "normal", session_id=session,
                             tenant=tenant, output_token_ids=replay, stream=ticket is not None)
            if self.on_work is not None:
                self.on_work(d)

        pd.transfer(d, tokens, tenant, start)

    # --------------------------------------------------------------------------------------- oracle
    def oracle_warm(self, inst, history: list[int], tenant: str = "") -> int:
        """Oracle (Table 2): register `history`'s whole pages in `inst`'s prefix cache without computing
        them (in-process instances). Returns the tokens resident afterwards."""
        resident, made = inst.import_prefix(history, tenant)
        self.oracle_tokens += made
        return resident

    # -------------------------------------------------------------------------------------- queries
    def all_instances(self) -> list:
        """Every instance once: the models' instances, then dedicated shadow instances (P/D: prefill only)."""
        seen, out = set(), []
        for inst in [i for group in self.instances.values() for i in group] + list(self.shadow_instances.values()):
            if id(inst) not in seen:
                seen.add(id(inst))
                out.append(inst)
        return out
