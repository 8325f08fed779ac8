"""P/D disaggregation over the orchestration core (paper §3.5, appendix B "Disaggregated cluster").

Each model's instances split into prefill (P) and decode (D) instances. The core (`ClusterManager`) places
calls and keeps shadows on the P instances as in a colocated cluster; `Disaggregation` adds what P/D
needs: decode placement, the D instances' inbound KV links, and shadow pushes. A call (routed or normal) is
prefilled on a P instance, which samples its first token; the core then continues it here: its KV moves
over the D instance's inbound link (tokens × KV bytes per token / (per-GPU link bandwidth × GPUs)), and the
D instance decodes the rest, its output going through the core's output handling like any other. A D
instance keeps a session's context after each call, so the next transfer sends only the tokens it lacks;
the transfer and the decode-queue wait count toward TPOT.

Shadow prefill: the session's shadow runs on its sticky P instance of the other model (that engine's
controller, with shadow-only iterations capped at 0.1 s); the sticky D instance of that model then pulls the
shadow KV in `push_tokens` (4K) pushes whenever its inbound link is idle, into free decode memory held as
evict-first shadow pages; pushed KV that D evicts again is lost, not re-sent. At a switch, the P instance
prefills only the uncached tail and the D instance receives only the tokens it lacks.

Modelling choices (the paper leaves them open): a D instance's link is one FIFO queue (normal and routed
transfers queue behind at most one 4K shadow push); KV that arrives on a D instance is registered in its
prefix cache without compute (`Instance.import_prefix`), and the D request prefills only the few tokens
after the last whole page plus the first token. The driver (simulator) provides `schedule(time, fn)` for
link events. D instances are in-process `cluster.instance.Instance`s, reached through their public calls.
"""
from __future__ import annotations

from typing import Callable

from shadowprefill.cluster.link import Link, LinkQueue

PUSH_TOKENS = 4096              # §3.5: "pulls the shadow KV in 4K-token pushes"
PD_SHADOW_ITERATION_S = 0.1     # §3.5: shadow iterations of at most 0.1 s on P instances


class Disaggregation:
    """Decode instances, their links, decode placement, KV transfers and shadow pushes of a P/D cluster.

    `decode[model]`: the D instances. `kv_bytes_per_token[model]`: KV bytes of one token on a whole
    instance; `link_bw_per_gpu`: bytes/s of each D GPU's inbound link. `schedule(t, fn)` runs fn at time t
    (None: transfers complete at once).
    """

    def __init__(self, decode: dict[str, list], *, kv_bytes_per_token: dict[str, float],
                 link_bw_per_gpu: float = 50e9, push_tokens: int = PUSH_TOKENS, schedule: Callable | None = None) -> None:
        if not isinstance(decode, dict) or not decode or not all(decode[m] for m in decode):
            raise ValueError("decode must give every model at least one decode instance")
        if isinstance(push_tokens, bool) or not isinstance(push_tokens, int) or push_tokens < 16:
            raise ValueError(f"push_tokens must be an int >= 16, got {push_tokens!r}")
        self.decode = decode
        self.kv_bytes_per_token = dict(kv_bytes_per_token)
        self.push_tokens = push_tokens
        self.schedule = schedule
        self.links = {id(d): LinkQueue(Link(link_bw_per_gpu * d.gpus)) for group in decode.values() for d in group}
        self.sticky_decode: dict[tuple[str, str], object] = {}
        self.shadow_pushed_tokens = 0
        self.shadow_push_lost = 0                     # pushes abandoned because D evicted earlier pushes
        self._push_wanted: dict[int, dict] = {}       # id(D) -> {session id: (P instance, tenant)}
        self._job_progress: dict[tuple, int] = {}     # (id(P), session) -> shadow num_cached last offered
        self._pushed_upto: dict[tuple, int] = {}      # (id(D), session) -> shadow prefix pushed so far

    def check(self, manager) -> None:
        """Called by the core: the decode side must cover its models."""
        if set(self.decode) != set(manager.instances):
            raise ValueError("decode must give every model at least one decode instance")
        if set(self.kv_bytes_per_token) < set(manager.instances):
            raise ValueError("kv_bytes_per_token must cover every model")

    def all_decoders(self) -> list:
        return [d for group in self.decode.values() for d in group]

    # ------------------------------------------------------------------------------ decode placement
    def decode_for(self, session_id: str | None, model: str):
        """The session's sticky D instance of `model` (the least loaded one for a new session / normal)."""
        if session_id is not None:
            inst = self.sticky_decode.get((session_id, model))
            if inst is not None:
                return inst
        inst = min(self.decode[model], key=lambda d: (d.num_unfinished_requests(), d.index))
        if session_id is not None:
            self.sticky_decode[(session_id, model)] = inst
        return inst

    def context_moved(self, d, session_id: str) -> None:
        """A routed call of the session decodes on `d`: the session's own context lives there from now on."""
        self._pushed_upto.pop((id(d), session_id), None)

    def oracle_warm(self, session_id: str, model: str, history: list[int], tenant: str) -> int:
        """Oracle on P/D: the switch call's kept history is on its D instance too. Returns tokens added."""
        return self.decode_for(session_id, model).import_prefix(list(history), tenant)[1]

    # ------------------------------------------------------------------------------------ transfers
    def transfer(self, dst, tokens: list[int], tenant: str, then: Callable[[], None]) -> None:
        """Move the KV of the tokens `dst` lacks over its link, register it there, then call `then`."""
        dev, host = dst.cached_prefix_tokens(tokens, tenant)
        missing = max(0, len(tokens) - dev - host)
        nbytes = missing * self.kv_bytes_per_token[dst.model]
        now = dst.now()
        done_at = self.links[id(dst)].reserve(now, nbytes)

        def arrive() -> None:
            dst.import_prefix(tokens, tenant)
            then()
            self._pump_link(dst)

        if self.schedule is None or done_at <= now:
            arrive()
        else:
            self.schedule(done_at, arrive)

    # -------------------------------------------------------------------------------- shadow pushes
    def offer_pushes(self, p_inst) -> None:
        """After a P iteration: every session whose shadow made progress there asks its sticky D instance
        of that model for a push (served when that D's link is idle)."""
        seen = self._job_progress
        for session_id in p_inst.shadow_sessions():
            job = p_inst.shadow_progress(session_id)
            key = (id(p_inst), session_id)
            if seen.get(key) == job.num_cached:
                continue
            seen[key] = job.num_cached
            d = self.decode_for(session_id, p_inst.model)
            wanted = self._push_wanted.setdefault(id(d), {})
            wanted.setdefault(session_id, (p_inst, job.tenant))
            self._pump_link(d)

    def _pump_link(self, d) -> None:
        """Start one shadow push to `d` if its link is idle: up to `push_tokens` of the shadow KV its P
        instance holds beyond what `d` holds, into evict-first (shadow-class) pages."""
        wanted = self._push_wanted.get(id(d))
        link = self.links[id(d)]
        now = d.now()
        if not wanted or link.free_at > now:
            return
        bs = d.block_size
        while wanted:
            session_id, (p_inst, tenant) = next(iter(wanted.items()))
            job = p_inst.shadow_progress(session_id)
            if job is None:
                del wanted[session_id]
                continue
            have_p = job.num_cached                     # the P engine's page-aligned belief
            have_d = sum(d.cached_prefix_tokens(job.token_ids, tenant))
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
                resident, _ = d.import_prefix(tokens, tenant, shadow=True)
                self._pushed_upto[key] = min(self._pushed_upto.get(key, 0), resident)
                self.shadow_pushed_tokens += n
                self._pump_link(d)

            if self.schedule is None:
                arrive()
            else:
                self.schedule(done_at, arrive)
            return
