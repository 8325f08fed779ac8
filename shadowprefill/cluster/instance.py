"""What the orchestration core needs of a serving instance (`InstanceHandle`), and the in-process backend.

The core (`cluster.manager.ClusterManager`) places calls and keeps shadows through these methods only, so
the same sessions, placement rule, prior and targets run over two backends:

- `Instance` (here): one `LLMEngine` in this process, the simulator's and the engine demo's instances. It
  takes a call's input as a shadow at once and the routed model's output tokens as they stream (§3.1,
  `incremental = True`).
- `serve.upstream.HttpInstance`: an OpenAI-compatible server (vLLM, SGLang, the built-in engine server).
  It takes a whole call as one shadow request after the call completed (appendix D.1, `incremental =
  False`).

`Instance` goes through the engine's public API only (never its pool, jobs or scheduler). Beside the
protocol it answers what Oracle, P/D transfers and per-call routers ask of an in-process engine: cached
prefix, imported prefix, shadow progress.
"""
from __future__ import annotations

from typing import Protocol

from shadowprefill.cluster.driver import EngineDriver

ROLES = ("serve", "dedicated", "prefill", "decode")


class InstanceHandle(Protocol):
    """One serving instance of one model, as the orchestration core uses it."""

    name: str
    model: str
    role: str               # "serve" (or "dedicated" / "prefill" / "decode", in-process only)
    incremental: bool       # True: shadow = call input at once + streamed output; False: the completed call

    def healthy(self) -> bool:
        """Whether calls may be placed here now."""

    def estimate_prefill_s(self, prompt, session, assume_cached: int | None = None) -> float:
        """Estimated seconds until `prompt` of `session` (a SessionState) would finish prefill here,
        counting the prefill queued ahead and only the prompt tokens not cached here (§3.1)."""

    def submit_call(self, ticket) -> object:
        """Start a routed call (`ticket`: a CallTicket); returns the backend's request object."""

    def upsert_shadow(self, session, history, switch_prob: float) -> None:
        """Make `history` the session's shadow target here (an extension keeps progress)."""

    def extend_shadow(self, session, tokens: list[int]) -> None:
        """Append streamed output tokens to the session's shadow here (if it has one)."""

    def cancel_shadow(self, session) -> None:
        """Drop the session's pending shadow work here (what was computed stays cached)."""


class Instance:
    """In-process backend: one `LLMEngine` plus its place in the cluster and its `EngineDriver`.

    `role`: "serve" (routed calls, normal traffic and harvested shadow work), "dedicated" (the Dedicated
    policy's extra instance: all shadow work of its model, routed calls, no normal traffic), or "prefill" /
    "decode" in a P/D-disaggregated cluster (`cluster.pd`). `latency_model` (optional) is the simulator's.
    """

    __slots__ = ("name", "model", "index", "engine", "latency_model", "role", "gpus", "driver")
    incremental = True

    def __init__(self, name: str, model: str, index: int, engine, latency_model=None, role: str = "serve",
                 gpus: int = 1) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.name, self.model, self.index, self.engine = name, model, index, engine
        self.latency_model, self.role, self.gpus = latency_model, role, gpus
        self.driver = EngineDriver(engine)

    def __repr__(self) -> str:
        return f"Instance({self.name!r}, {self.role})"

    # ---------------------------------------------------------------------------------- InstanceHandle
    def healthy(self) -> bool:
        return self.driver.error is None

    def estimate_prefill_s(self, prompt, session, assume_cached: int | None = None) -> float:
        return self.engine.estimate_prefill_s(prompt, session.tenant, assume_cached)

    def submit_call(self, ticket):
        """Queue the call's current stage as a routed request; returns the engine's Request."""
        session = ticket.session
        return self.engine.add_request(ticket.request_id, ticket.prompt, ticket.stage_max_tokens,
                                       priority="routed", session_id=ticket.session_id,
                                       tenant=session.tenant if session is not None else "",
                                       output_token_ids=ticket.replay)

    def upsert_shadow(self, session, history, switch_prob: float) -> None:
        self.engine.add_shadow(session.session_id, history, switch_prob=switch_prob, tenant=session.tenant)

    def extend_shadow(self, session, tokens: list[int]) -> None:
        self.engine.extend_shadow(session.session_id, tokens)

    def cancel_shadow(self, session) -> None:
        self.engine.cancel_shadow(session.session_id)

    # ------------------------------------------------------------------------- in-process extras
    def submit_request(self, request_id: str, prompt, max_tokens: int, priority: str = "normal",
                       session_id: str | None = None, tenant: str = "", output_token_ids=None, stream: bool = True):
        """Queue any other request (normal traffic, a P/D decode stage); returns the engine's Request.
        `stream` False: its only RequestOutput is the final one."""
        return self.engine.add_request(request_id, prompt, max_tokens, priority=priority, session_id=session_id,
                                       tenant=tenant, output_token_ids=output_token_ids, stream=stream)

    def cached_prefix_tokens(self, tokens, tenant: str = "") -> tuple[int, int]:
        """(device, host) tokens of `tokens`' longest cached prefix here (a peek: nothing changes)."""
        return self.engine.cached_prefix_tokens(tokens, tenant)

    def import_prefix(self, tokens, tenant: str = "", shadow: bool = False) -> tuple[int, int]:
        """Register `tokens`' whole pages here without computing them (Oracle, P/D arrivals)."""
        return self.engine.import_prefix(tokens, tenant, shadow=shadow)

    def shadow_progress(self, session_id: str):
        return self.engine.shadow_progress(session_id)

    def shadow_sessions(self) -> list[str]:
        return self.engine.shadow_sessions()

    def num_unfinished_requests(self) -> int:
        return self.engine.num_unfinished_requests()

    @property
    def block_size(self) -> int:
        return self.engine.config.block_size

    def now(self) -> float:
        return self.engine.clock.now()
