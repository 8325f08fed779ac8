"""What the shadow controller reads of one iteration: a small read-only view any engine can fill.

The controller (Algorithm 1) never sees an engine's scheduler, pool or request objects; it reads

- per in-flight routed/normal request (`RequestState`, duck-typed: this project's `engine.Request` has
  these attributes, the vLLM plugin adapts vLLM's requests): arrival a_r, first-token time f_r (None while
  prefilling), iterations done k_r, tokens computed before this step and tokens still uncomputed, and the
  SLOs F_r / T_r;
- the iteration (`IterationView`): decodes, prefill chunks with their new tokens this step, whether a
  routed call is in it, whether non-shadow work waits or an admission was blocked by memory (line 1), how
  many tokens and sequences are already scheduled, and the free shadow KV (line 11, possibly lazy: a
  callable, since counting cold pages costs a scan).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence


_computed = operator.attrgetter("num_computed_tokens")


class RequestState(Protocol):
    """One in-flight routed or normal request, as the controller reads it (attributes, read-only)."""

    arrival_time: float              # a_r (seconds, the engine's clock)
    first_token_time: float | None   # f_r; None while the request has not produced its first token
    num_decode_iters: int            # k_r: iterations completed since the first token
    num_computed_tokens: int         # tokens whose KV exists before this step
    num_remaining: int               # known tokens without KV before this step (1 for a decode)
    ttft_slo: float                  # F_r (seconds)
    tpot_slo: float                  # T_r (seconds)


@dataclass(slots=True)
class IterationView:
    """The routed/normal part of one iteration, before shadow work is added.

    `free_shadow_tokens(limit)` returns the tokens of KV a shadow chunk may take now (free or cold pages
    within the shadow cap), at most `limit`; an int is taken as it is.
    """

    now: float
    decodes: Sequence[RequestState]
    prefills: Sequence[tuple[RequestState, int]]      # (request, new tokens this step)
    has_routed: bool
    waiting: bool = False
    admission_blocked: bool = False
    num_tokens: int = 0
    num_seqs: int = 0
    free_shadow_tokens: "int | Callable[[int], int]" = 0
    contexts: "list[int] | None" = None               # decode_contexts(), when the engine already has them

    @property
    def has_requests(self) -> bool:
        """B ≠ ∅ in Algorithm 1: the iteration carries routed or normal work."""
        return bool(self.decodes or self.prefills)

    def free_shadow(self, limit: int) -> int:
        """Line 11's free shadow KV in tokens, at most `limit`."""
        free = self.free_shadow_tokens
        return min(limit, free(limit) if callable(free) else int(free))

    def prefill_pairs(self) -> list[tuple[int, int]]:
        """Prefill chunks as (new tokens, cached before): the latency model's and predictor's input."""
        return prefill_pairs(self.prefills)

    def decode_contexts(self) -> list[int]:
        """Context of every decode (tokens attended, the new one included)."""
        contexts = self.contexts
        return decode_contexts(self.decodes) if contexts is None else contexts


def prefill_pairs(prefills: Sequence[tuple[RequestState, int]]) -> list[tuple[int, int]]:
    """Prefill chunks (request, new tokens) as (new tokens, cached before)."""
    return [(n, r.num_computed_tokens) for r, n in prefills]


def decode_contexts(decodes: Sequence[RequestState]) -> list[int]:
    """Each decode's context: tokens attended, the new one included."""
    return [c + 1 for c in map(_computed, decodes)]
