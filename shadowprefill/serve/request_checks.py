"""Sampling fields of an OpenAI request: implemented, or rejected with a message naming the field.

`check_request(body, greedy_only)` returns None when the request can be served as asked, else the message
of an HTTP 400. Both servers answer one choice (`n` must be 1, `best_of` absent or 1: the manager's session
history and shadows follow one answer). Malformed values (NaN, wrong type, out of range) are rejected
everywhere. The manager forwards valid sampling fields to its upstream (vLLM implements them). The built-in
`serve-engine` decodes greedily and has no logprobs, stop strings or penalties, so it rejects (`greedy_only`)
every field that would change the answer: `temperature` other than 0, `top_p` other than 1, `top_k` other
than -1/0, `min_p` other than 0, penalties other than 0 (repetition 1), `logprobs` / `top_logprobs`,
`echo`, `stop`, `stop_token_ids`, `logit_bias`, `suffix`, `response_format`, `tools`. `seed` is accepted
(greedy decoding is deterministic).
"""
from __future__ import annotations

import math

_NEUTRAL = {"temperature": (0,), "top_p": (1,), "top_k": (-1, 0), "min_p": (0,), "presence_penalty": (0,),
            "frequency_penalty": (0,), "repetition_penalty": (1,)}
_RANGES = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0), "presence_penalty": (-2.0, 2.0),
           "frequency_penalty": (-2.0, 2.0), "repetition_penalty": (0.0, math.inf)}
_UNSUPPORTED_BUILTIN = ("logprobs", "top_logprobs", "echo", "stop", "stop_token_ids", "logit_bias", "suffix",
                        "response_format", "tools", "tool_choice")


def _number(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float))


def check_request(body: dict, greedy_only: bool) -> str | None:
    """None if `body`'s sampling fields can be honoured, else a message naming the first offending field."""
    for name in ("n", "best_of"):
        v = body.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v != 1):
            return f"{name}: only one choice per request is supported ({name}=1), got {v!r}"
    for name, (lo, hi) in _RANGES.items():
        v = body.get(name)
        if v is None:
            continue
        if not _number(v) or not math.isfinite(v) or not lo <= v <= hi:
            return f"{name} must be a finite number in [{lo}, {hi}], got {v!r}"
        if greedy_only and v not in _NEUTRAL[name]:
            return (f"{name}={v!r} is not supported: this server decodes greedily (send {name}="
                    f"{_NEUTRAL[name][0]} or omit it)")
    v = body.get("top_k")
    if v is not None:
        if isinstance(v, bool) or not isinstance(v, int) or v < -1:
            return f"top_k must be an integer >= -1, got {v!r}"
        if greedy_only and v not in _NEUTRAL["top_k"]:
            return f"top_k={v!r} is not supported: this server decodes greedily (omit it)"
    v = body.get("seed")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
        return f"seed must be an integer, got {v!r}"
    v = body.get("logprobs")
    if v is not None and not isinstance(v, (bool, int)):
        return f"logprobs must be an integer or a boolean, got {v!r}"
    if greedy_only:
        for name in _UNSUPPORTED_BUILTIN:
            v = body.get(name)
            if not (v is None or v is False or v == [] or v == ""):
                return f"{name} is not supported by this server, got {v!r}"
    return None
