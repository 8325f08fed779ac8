"""What a session's calls look like over HTTP: shadow content, prefix beliefs, and the live router.

Sessions themselves are the orchestration core's (`cluster.session.SessionState`, keyed by (tenant,
session id)); this module knows the OpenAI request forms (token ids, text, chat messages).

Shadow content (paper appendix D.1): after a call completes, the other model should hold the next call's
prefix. For an append-only session that is the call's prompt followed by its response:
- `/v1/completions`: prompt + response (token ids + generated ids when the prompt was token ids, else
  text + text);
- `/v1/chat/completions`: the messages followed by the assistant's answer, rendered up to the end of the
  answer (`add_generation_prompt: false`, `continue_final_message: true`): the next turn's prefix.
A session whose prompts stopped extending the previous prompt + response (a compacted or rewritten
history) is non-append-only: the next prompt's overlap with this call is at most this call's prompt, so
the shadow is the prompt alone (the longest common prefix, capped at the completed prompt). The server
side keeps whatever prefix of an older shadow still matches (`ShadowRequest.update`; vLLM's prefix cache).

Prefix beliefs (`comparable`): the manager does not tokenize, so to estimate how much of a prompt an
upstream caches it compares the prompt with what that upstream was last given for the session, as token
ids, or as text at `CHARS_PER_TOKEN` characters per token (chat messages rendered as role + content).
"""
from __future__ import annotations

from shadowprefill.cluster.router import MarkovRouter

CHARS_PER_TOKEN = 4.0          # text and chat prompts: a rough size in tokens, for placement estimates


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


def comparable(content) -> tuple[object, float]:
    """(a sequence whose common prefix with another prompt's measures shared context, its elements per
    token): token ids as they are; text, or chat messages rendered as role + content, at CHARS_PER_TOKEN.
    `content`: a prompt, chat messages, or a shadow body holding either."""
    if isinstance(content, dict):
        content = content.get("messages", content.get("prompt"))
    if isinstance(content, str):
        return content, CHARS_PER_TOKEN
    if isinstance(content, list) and content and isinstance(content[0], dict):
        return "".join(f"\x1e{m.get('role', '')}\x1f{m.get('content') or ''}" for m in content), CHARS_PER_TOKEN
    if isinstance(content, list):
        return content, 1.0
    return "", CHARS_PER_TOKEN


class LiveRouter:
    """The per-step router: "request" uses the call's `model` field (the agent's or an external router's
    decision); "markov" applies `cluster.router.MarkovRouter` (switch with probability p per step, seeded
    per (session, call)) over the configured models, to the live session as it is."""

    def __init__(self, spec: dict, models: list[str]) -> None:
        self.kind = spec.get("type", "request")
        self.models = list(models)
        self._markov = None
        if self.kind == "markov":
            self._markov = MarkovRouter(self.models, float(spec.get("p", 0.3)), seed=int(spec.get("seed", 0)))
        elif self.kind != "request":
            raise ValueError(f"router type must be 'request' or 'markov', got {self.kind!r}")

    def route(self, state, requested: str | None) -> str:
        """The model for the next call of `state` (a SessionState, None for a stateless call); ValueError
        if the requested model is not configured."""
        if self._markov is None or state is None:
            if requested not in self.models:
                raise ValueError(f"model {requested!r} is not served here; models: {self.models}")
            return requested
        return self._markov.route(state, state.num_calls, list(state.models))
