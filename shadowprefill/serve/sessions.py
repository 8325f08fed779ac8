"""Sessions as the manager sees them, the per-step router, and what a shadow submission holds.

A session is keyed by (tenant, session id): two tenants using the same id never share state, and a
session's shadows are built only from its own calls (tenant isolation). Per session the manager keeps the
models of its calls (the router's history), a sticky instance per model, and the last completed call.

Shadow content (paper appendix D.1): after a call completes, the other model should hold the next call's
prefix. For an append-only session that is the call's prompt followed by its response:
- `/v1/completions`: prompt + response (token ids + generated ids when the prompt was token ids, else
  text + text);
- `/v1/chat/completions`: the messages followed by the assistant's answer, rendered up to the end of the
  answer (`add_generation_prompt: false`, `continue_final_message: true`): the next turn's prefix.
A session whose prompts stopped extending the previous prompt + response (a compacted or rewritten
history) is non-append-only: the next prompt's overlap with this call is at most this call's prompt, so
the shadow is the prompt alone (the longest common prefix, capped at the completed prompt). The server
side keeps whatever prefix of an older shadow still matches (`ShadowJob.update`; vLLM's prefix cache).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from shadowprefill.cluster.router import MarkovRouter
from shadowprefill.cluster.workloads import Call, Session


@dataclass
class SessionState:
    tenant: str
    session_id: str
    shadow_enabled: bool = True
    history: list[str] = field(default_factory=list)        # model of each completed call
    sticky: dict[str, str] = field(default_factory=dict)    # model -> instance URL
    last_prompt: object = None                              # prompt (str / ids / messages) of the last call
    last_response: object = None                            # its response (str, or ids for id prompts)
    append_only: bool = True
    num_calls: int = 0                                      # calls started (call index of the next)

    @property
    def key(self) -> tuple[str, str]:
        return (self.tenant, self.session_id)


def extends(prompt, previous_prompt, previous_response) -> bool:
    """Does `prompt` start with the previous prompt followed by its response?"""
    if previous_prompt is None:
        return True
    if isinstance(prompt, str) and isinstance(previous_prompt, str):
        return prompt.startswith(previous_prompt + (previous_response or ""))
    if isinstance(prompt, list) and isinstance(previous_prompt, list):
        if prompt and isinstance(prompt[0], dict):                      # chat messages
            head = previous_prompt + [{"role": "assistant", "content": previous_response or ""}]
            return len(prompt) >= len(head) and all(
                a.get("role") == b.get("role") and a.get("content") == b.get("content")
                for a, b in zip(prompt, head))
        head = previous_prompt + list(previous_response or [])
        return prompt[:len(head)] == head
    return False


def shadow_body(kind: str, prompt, response, append_only: bool) -> dict | None:
    """The request body (without model/priority) that makes a server hold this call's next-turn prefix."""
    if kind == "chat":
        if not append_only:
            return {"messages": prompt, "add_generation_prompt": False, "continue_final_message": True}
        messages = list(prompt) + [{"role": "assistant", "content": response or ""}]
        return {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    if isinstance(prompt, str):
        return {"prompt": prompt + (response or "") if append_only else prompt}
    if isinstance(prompt, list):
        return {"prompt": list(prompt) + list(response or []) if append_only else list(prompt)}
    return None


class LiveRouter:
    """The per-step router: "request" uses the call's `model` field (the agent's or an external router's
    decision); "markov" applies `cluster.router.MarkovRouter` (switch with probability p per step, seeded
    per (session, call)) over the configured models."""

    def __init__(self, spec: dict, models: list[str]) -> None:
        self.kind = spec.get("type", "request")
        self.models = list(models)
        self._markov = None
        if self.kind == "markov":
            self._markov = MarkovRouter(self.models, float(spec.get("p", 0.3)), seed=int(spec.get("seed", 0)))
        elif self.kind != "request":
            raise ValueError(f"router type must be 'request' or 'markov', got {self.kind!r}")

    def route(self, state: SessionState, requested: str | None) -> str:
        """The model for the session's next call; ValueError if the requested model is not configured."""
        if self._markov is None:
            if requested not in self.models:
                raise ValueError(f"model {requested!r} is not served here; models: {self.models}")
            return requested
        calls = [Call(model=m, new_input_tokens=1, output_tokens=1) for m in state.history]
        calls.append(Call(model=requested if requested in self.models else self.models[0],
                          new_input_tokens=1, output_tokens=1))
        session = Session(state.session_id, state.tenant, "live", 0.0, calls)
        return self._markov.route(session, len(state.history), list(state.history))


class NextModelPrior:
    """Counts of (current model -> next model) over the manager's sessions: the top-1 shadow target."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}

    def observe(self, previous: str, current: str) -> None:
        self.counts[(previous, current)] = self.counts.get((previous, current), 0) + 1

    def rank(self, current: str, others: list[str]) -> list[str]:
        """`others` by how often they followed `current` (ties keep the configured order)."""
        return sorted(others, key=lambda m: -self.counts.get((current, m), 0))
