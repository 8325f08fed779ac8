"""An agentic session as the orchestration core sees it (paper §3.1).

A session is keyed by (tenant, session id): two tenants using the same id never share state, and a session's
shadows are built only from its own calls (tenant isolation). The core keeps, per session, the route so far
(the router's history), a sticky instance per model ("Sticky model placement") and the instances that hold
one of its shadows. Routers read `session_id`, `task` and `models` directly (no stand-in objects).

`last_prompt` / `last_response` / `append_only` are the last completed call in the front end's own form
(token ids, text or chat messages): the HTTP front end builds its request-level shadows from them
(appendix D.1); the in-process backends stream tokens instead and leave them unset.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class SessionState:
    session_id: str
    tenant: str = ""
    task: str = ""
    shadow_enabled: bool = True
    models: list = field(default_factory=list)          # model of each routed call so far
    sticky: dict = field(default_factory=dict)          # model -> InstanceHandle
    shadow_on: set = field(default_factory=set)         # handles holding one of this session's shadows
    last_prompt: object = None
    last_response: object = None
    append_only: bool = True
    calls_in_flight: int = 0
    last_active: float = 0.0                            # when its last call started or finished (front end)

    @property
    def key(self) -> tuple[str, str]:
        return (self.tenant, self.session_id)

    @property
    def current_model(self) -> str | None:
        """The model of the session's latest call (None before its first)."""
        return self.models[-1] if self.models else None

    @property
    def num_calls(self) -> int:
        return len(self.models)
