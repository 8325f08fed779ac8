"""P/D-disaggregated cluster manager (paper §3.5, appendix B "Disaggregated cluster").

Each model's instances split into prefill (P) and decode (D) instances. A call (routed or normal) is
prefilled on a P instance, which samples its first token; its KV then moves over the D instance's inbound
link (tokens × KV bytes per token / (per-GPU link bandwidth × GPUs)), and the D instance decodes the rest.
A D instance keeps a session's context after each call, so the next transfer sends only the tokens it
lacks; the transfer and the decode-queue wait count toward TPOT.

Shadow prefill: the session's shadow job runs on its sticky P instance of the other model (that engine's
controller, with shadow-only iterations capped at 0.1 s); the sticky D instance of that model then pulls the
shadow KV in `push_tokens` (4K) pushes whenever its inbound link is idle, into free decode memory held as
evict-first shadow pages; pushed KV that D evicts again is lost, not re-sent. At a switch, the P instance
prefills only the uncached tail and the D instance receives only the tokens it lacks.

Modelling choices (the paper leaves them open): a D instance's link is one FIFO queue (normal and routed
transfers queue behind at most one 4K shadow push); KV that arrives on a D instance is registered in its
prefix cache without compute (`LLMEngine.import_prefix`), and the D request prefills only the few tokens after the
last whole page plus the first token. The driver (simulator) provides `schedule(time, fn)` for link events.
"""
from __future__ import annotations

from typing import Callable

from shadowprefill.cluster.manager import CallTicket, ClusterManager, Instance

PUSH_TOKENS = 4096              # §3.5: "pulls the shadow KV in 4K-token pushes"
PD_SHADOW_ITERATION_S = 0.1     # §3.5: shadow iterations of at most 0.1 s on P instances


class Link:
    """A decode instance's inbound KV link: FIFO, `bytes_per_s` over all its GPUs."""

    __slots__ = ("bytes_per_s", "free_at", "bytes_moved", "busy_s")

    def __init__(self, bytes_per_s: float) -> None:
        if not bytes_per_s > 0:
            raise ValueError(f"link bandwidth must be > 0, got {bytes_per_s}")
        self.bytes_per_s = bytes_per_s
        self.free_at = 0.0
        self.bytes_moved = 0
        self.busy_s = 0.0

    def reserve(self, now: float, nbytes: float) -> float:
        """Queue a transfer of nbytes; returns its completion time."""
        start = max(now, self.free_at)
        duration = nbytes / self.bytes_per_s
        self.free_at = start + duration
        self.bytes_moved += int(nbytes)
        self.busy_s += duration
        return self.free_at


class PDClusterManager(ClusterManager):
    """Routed and normal calls over P and D instances, with shadow jobs on P and pushes to D.

    `instances[model]`: the P instances (placement, sticky P, shadow homes, as in the colocated manager);
    `decode[model]`: the D instances. `kv_bytes_per_token[model]`: KV bytes of one token on a whole
    instance; `link_bw_per_gpu`: bytes/s of each D GPU's inbound link. `schedule(t, fn)` runs fn at time t.
    """

    def __init__(self, instances: dict[str, list[Instance]], decode: dict[str, list[Instance]], *,
                 kv_bytes_per_token: dict[str, float], link_bw_per_gpu: float = 50e9,
                 push_tokens: int = PUSH_TOKENS, schedule: Callable | None = None, **kwargs) -> None:
        super().__init__(instances, **kwargs)
        if set(decode) != set(instances) or not all(decode[m] for m in decode):
            raise ValueError("decode must give every model at least one decode instance")
        if set(kv_bytes_per_token) < set(instances):
            raise ValueError("kv_bytes_per_token must cover every model")
        if isinstance(push_tokens, bool) or not isinstance(push_tokens, int) or push_tokens < 16:
            raise ValueError(f"push_tokens must be an int >= 16, got {push_tokens!r}")
        self.decode = decode
        self.kv_bytes_per_token = dict(kv_bytes_per_token)
        self.push_tokens = push_tokens
        self.schedule = schedule
        self.links = {id(d): Link(link_bw_per_gpu * d.gpus) for group in decode.values() for d in group}
        self.sticky_decode: dict[tuple[str, str], Instance] = {}
        self._prefill_ids = {id(i) for group in instances.values() for i in group}
        self._totals: dict[str, int] = {}             # routed request id -> the call's output tokens
        self._pending_normal: dict[str, tuple] = {}   # normal request id on P -> (Request, output tokens)
        self._normal_first: dict[str, tuple] = {}     # normal request id on D -> (original id, first token)
        self._push_wanted: dict[int, dict] = {}       # id(D) -> {session id: (P instance, tenant)}
        self._job_progress: dict[tuple, int] = {}     # (id(P), session) -> job.num_cached last offered
        self.shadow_pushed_tokens = 0
        self.shadow_push_lost = 0                     # pushes abandoned because D evicted earlier pushes
        self._pushed_upto: dict[tuple, int] = {}      # (id(D), session) -> shadow prefix pushed so far

    # ------------------------------------------------------------------------------------------ helpers
    def _decode_for(self, session_id: str | None, model: str) -> Instance:
        """The session's sticky D instance of `model` (the least loaded one for a new session / normal)."""
        if session_id is not None:
            inst = self.sticky_decode.get((session_id, model))
            if inst is not None:
                return inst
        inst = min(self.decode[model], key=lambda d: (d.engine.num_unfinished_requests(), d.index))
        if session_id is not None:
            self.sticky_decode[(session_id, model)] = inst
        return inst

    def _transfer(self, dst: Instance, tokens: list[int], tenant: str, then: Callable[[], None]) -> None:
        """Move the KV of the tokens `dst` lacks over its link, register it there, then call `then`."""
        dev, host = dst.engine.cached_prefix_tokens(tokens, tenant)
        missing = max(0, len(tokens) - dev - host)
        nbytes = missing * self.kv_bytes_per_token[dst.model]
        now = dst.engine.clock.now()
        done_at = self.links[id(dst)].reserve(now, nbytes)

        def arrive() -> None:
            dst.engine.import_prefix(tokens, tenant)
            then()
            self._pump_link(dst)

        if self.schedule is None or done_at <= now:
            arrive()
        else:
            self.schedule(done_at, arrive)

    # ---------------------------------------------------------------------------------------------- calls
    def submit_call(self, session_id: str, call_index: int, model: str, prompt_token_ids, max_tokens: int, *,
                    task: str = "", tenant: str = "", kept_prefix: int | None = None,
                    output_token_ids=None) -> CallTicket:
        """Prefill on the sticky/least-loaded P instance (first token there), then decode on the sticky D."""
        ticket = super().submit_call(session_id, call_index, model, prompt_token_ids, 1, task=task,
                                     tenant=tenant, kept_prefix=kept_prefix, output_token_ids=output_token_ids)
        self._totals[ticket.request_id] = max_tokens   # the whole call's; the P request samples one token
        ticket.output_tokens = max_tokens
        if self.oracle and ticket.is_switch and kept_prefix:
            d = self._decode_for(session_id, model)
            history = list(prompt_token_ids)[:kept_prefix]
            self.oracle_tokens += d.engine.import_prefix(history, self.sessions[session_id].tenant)[1]
        return ticket

    def submit_normal(self, inst: Instance, request_id: str, prompt_token_ids, max_tokens: int):
        """Normal traffic enters at a P instance; its decode runs on the least-loaded D instance."""
        request = inst.engine.add_request(request_id, prompt_token_ids, 1, priority="normal")
        self._pending_normal[request_id] = (request, max_tokens)
        if self.on_work is not None:
            self.on_work(inst)
        return request

    def on_outputs(self, inst: Instance, outputs) -> list[CallTicket]:
        """P instance: finished prefills start their transfer + decode; D instance: stream routed output
        into shadow jobs, finish calls and normal requests."""
        if id(inst) in self._prefill_ids:
            return self._prefill_outputs(inst, outputs)
        return self._decode_outputs(inst, outputs)

    def _prefill_outputs(self, inst: Instance, outputs) -> list[CallTicket]:
        done: list[CallTicket] = []
        for out in outputs:
            if not out.finished:
                continue
            rid = out.request_id
            ticket = self.tickets.get(rid)
            if ticket is None:
                pending = self._pending_normal.pop(rid, None)
                if pending is None:
                    continue
                request, total = pending
                if total <= 1:
                    self.finished_normal.append((rid, out.first_token_time, out.finish_time))
                else:
                    self._start_decode(inst, rid, request.all_token_ids, None, total, "", out.first_token_time)
                continue
            ticket.output = out
            for home in ticket.stream_to:                          # the first token streams into shadows
                home.engine.extend_shadow(ticket.session_id, [out.new_token_id])
            ticket.fill_from(ticket.request)                       # arrival, first token, P cache hits, SLOs
            total = self._totals.pop(rid, 1)
            if total <= 1:
                del self.tickets[rid]
                done.append(ticket)
            else:
                tenant = self.sessions[ticket.session_id].tenant if ticket.session_id in self.sessions else ""
                self._start_decode(inst, rid, ticket.request.all_token_ids, ticket, total, tenant,
                                   out.first_token_time)
        self._offer_pushes(inst)
        return done

    def _start_decode(self, p_inst: Instance, rid: str, tokens: list[int], ticket: CallTicket | None, total: int,
                      tenant: str, first_token: float) -> None:
        """Transfer the prompt's KV (and first token) to the D instance, then decode the rest there."""
        session = ticket.session_id if ticket is not None else None
        d = self._decode_for(session, p_inst.model)
        d_rid = rid + "@d"
        replay = None
        if ticket is not None:
            del self.tickets[rid]
            self.tickets[d_rid] = ticket
            self._pushed_upto.pop((id(d), session), None)   # the session's own context on D from now on
            ticket.instance = d
            replay = ticket.request.replay_token_ids
            replay = None if replay is None else replay[1:]    # the D request replays the rest of the output
        else:
            self._normal_first[d_rid] = (rid, first_token)
        tokens = list(tokens)

        def start() -> None:
            d.engine.add_request(d_rid, tokens, total - 1, priority="routed" if ticket else "normal",
                                 session_id=session, tenant=tenant, output_token_ids=replay)
            if self.on_work is not None:
                self.on_work(d)

        self._transfer(d, tokens, tenant, start)

    def _decode_outputs(self, inst: Instance, outputs) -> list[CallTicket]:
        done: list[CallTicket] = []
        fed: dict[int, Instance] = {}
        for out in outputs:
            rid = out.request_id
            ticket = self.tickets.get(rid)
            if ticket is None:
                if out.finished and rid in self._normal_first:
                    orig, first = self._normal_first.pop(rid)
                    self.finished_normal.append((orig, first, out.finish_time))
                continue
            self._stream_output(ticket, out, fed)
            if out.finished:
                del self.tickets[rid]
                ticket.finish = out.finish_time
                ticket.output_tokens = 1 + out.num_output_tokens
                done.append(ticket)
        if self.on_work is not None:
            for home in fed.values():
                self.on_work(home)
        return done

    # ------------------------------------------------------------------------------------ shadow pushes
    def _offer_pushes(self, p_inst: Instance) -> None:
        """After a P iteration: every session whose shadow job made progress here asks its sticky D
        instance of this model for a push (served when that D's link is idle)."""
        engine = p_inst.engine
        seen = self._job_progress
        for session_id in engine.shadow_sessions():
            job = engine.shadow_progress(session_id)
            key = (id(p_inst), session_id)
            if seen.get(key) == job.num_cached:
                continue
            seen[key] = job.num_cached
            d = self._decode_for(session_id, p_inst.model)
            wanted = self._push_wanted.setdefault(id(d), {})
            wanted.setdefault(session_id, (p_inst, job.tenant))
            self._pump_link(d)

    def _pump_link(self, d: Instance) -> None:
        """Start one shadow push to `d` if its link is idle: up to `push_tokens` of the shadow KV its P
        instance holds beyond what `d` holds, into evict-first (shadow-class) pages."""
        wanted = self._push_wanted.get(id(d))
        link = self.links[id(d)]
        now = d.engine.clock.now()
        if not wanted or link.free_at > now:
            return
        bs = d.engine.config.block_size
        while wanted:
            session_id, (p_inst, tenant) = next(iter(wanted.items()))
            job = p_inst.engine.shadow_progress(session_id)
            if job is None:
                del wanted[session_id]
                continue
            have_p = job.num_cached                     # the P engine's page-aligned belief
            have_d = sum(d.engine.cached_prefix_tokens(job.token_ids, tenant))
            key = (id(d), session_id)
            if have_d < self._pushed_upto.get(key, 0):   # D evicted pushed shadow KV: lost, never re-sent
                self.shadow_push_lost += 1
                del wanted[session_id]
                continue
            n = min(self.push_tokens, have_p - have_d) // bs * bs
            if n < bs:
                del wanted[session_id]
                continue
            tokens = job.token_ids[:have_d + n]
            done_at = link.reserve(now, n * self.kv_bytes_per_token[d.model])
            self._pushed_upto[key] = have_d + n

            def arrive(d=d, tokens=tokens, tenant=tenant, n=n, key=key) -> None:
                resident, _ = d.engine.import_prefix(tokens, tenant, shadow=True)
                self._pushed_upto[key] = min(self._pushed_upto.get(key, 0), resident)
                self.shadow_pushed_tokens += n
                self._pump_link(d)

            if self.schedule is None:
                arrive()
            else:
                self.schedule(done_at, arrive)
            return
