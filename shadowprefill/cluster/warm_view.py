"""Read-only view of how warm a call's prompt is on each candidate model (for per-call routers).

A per-call router that prices a model by its warm prefix (paper 003 §III-A: the gateway picks the target
model knowing which KV it can reuse; paper 000 §5.1: cached input is billed at 0.1x) needs, at the moment
call k is issued, the answer to: "if I sent this prompt to model m now, which instance would serve it and
how many of its tokens would that instance find cached?". `WarmView` answers exactly that, with the same
placement rule as the manager (`ClusterManager.place`, lowest estimated prefill completion) and the same
pool lookup (`LLMEngine.cached_prefix_tokens`, a peek: no references taken, no LRU touched, no bytes moved),
so asking never changes the run. Answers are computed on first use and kept for the call.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class WarmPrefix:
    """What a call placed on `model` now would find cached, on the instance the manager would pick."""

    model: str
    instance: str           # name of that instance
    prompt_tokens: int
    device_tokens: int      # cached in HBM (normal or shadow pages)
    host_tokens: int        # cached in the host tier only (reloaded at admission)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens billed as cached input (device + host)."""
        return self.device_tokens + self.host_tokens


class WarmView:
    """Per-model warm prefix of one call's prompt on a `ClusterManager` (P/D: on its prefill
    instances). `models` lists the candidates (the manager's deployed models)."""

    def __init__(self, manager, session_id: str, prompt: Sequence[int], tenant: str = "") -> None:
        if not hasattr(manager, "place") or not hasattr(manager, "instances"):
            raise TypeError(f"manager must be a ClusterManager, got {type(manager).__name__}")
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session_id must be a non-empty str, got {session_id!r}")
        if len(prompt) < 1:
            raise ValueError("prompt must not be empty")
        self.manager = manager
        self.session_id = session_id
        self.prompt = prompt if isinstance(prompt, list) else list(prompt)
        self.tenant = tenant
        self._seen: dict[str, WarmPrefix] = {}

    @property
    def models(self) -> list[str]:
        return list(self.manager.models)

    def __getitem__(self, model: str) -> WarmPrefix:
        """The warm prefix of the prompt on `model` (computed on first use)."""
        hit = self._seen.get(model)
        if hit is None:
            if model not in self.manager.instances:
                raise ValueError(f"model {model!r} is not deployed; deployed: {self.models}")
            inst = self.manager.place(self.session_id, model, self.prompt, self.tenant)
            # the engine always computes the last prompt token (its logits give the first output token), so
            # only full pages within prompt[:-1] can be hits, as at admission (Scheduler._admit)
            device, host = inst.cached_prefix_tokens(self.prompt[:-1], self.tenant)
            hit = self._seen[model] = WarmPrefix(model, inst.name, len(self.prompt), device, host)
        return hit
