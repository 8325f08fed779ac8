"""Algorithm 1 line 15, once for every host: spend one iteration's shadow budget on shadow work.

    10: n ← max{n : t̂(B + n shadow tokens) ≤ b}
    11: n ← min(n, free shadow KV)
    12: if n < n_min then return 0
    15: take n tokens from jobs in Q by switch probability

`spend_budget` walks the shadow candidates in the order it is given (the host sorts them: by switch
probability in this project's engine, by (priority, arrival) in the vLLM plugin) and gives each the largest
chunk lines 10-12 allow at its own cached context, in whole pages, until the budget (a
`controller.ShadowBudget`) is spent. It knows nothing of engines: a host describes its candidates through
four calls (`SpendHost`), so the engine's scheduler and the vLLM plugin's `_take` share this one function.

Chunk size, for a candidate with `context` cached tokens and `remaining` tokens still to compute:
- at most `budget.room()` (token budget, sequences, free shadow KV) and `limit − taken` (a host's own
  allowance, e.g. the plugin's per-step token budget);
- at most what t̂ allows (line 10; with a host-tier reload the part of the copy the compute does not hide
  counts too), and the free shadow KV (line 11);
- `context + n` on a page boundary, and n ≥ n_min (line 12), unless the chunk completes the candidate
  (`n == remaining`) and the host allows short last chunks (`short_last`, a request that must finish);
- `probe=True` (t̂ not trusted yet): one chunk of at most n_min tokens, whatever t̂ says, to teach t̂.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence, TypeVar

C = TypeVar("C")


class SpendHost(Protocol[C]):
    """What `spend_budget` needs of the host that holds the shadow work (engine scheduler, vLLM plugin).

    `locate(c)` finds how much of candidate `c` is cached (a prefix-cache lookup; it may hold the hit pages)
    and returns `(context_tokens, remaining_tokens, reload)`, `reload` being `(overlap, host_tokens)` when
    the cached prefix comes back from a host tier through a layer-wise reload (see
    `ShadowBudget.reload_s`) or None; it returns None to skip `c` with nothing held (e.g. no sequence slot).
    `allocate(c, context, n)` gets KV for `n` new tokens after `context`; False means line 11 refused (no
    KV within the shadow cap) and nothing is held beyond what `locate` held. `release(c)` undoes `locate`'s
    holds when `c` is skipped. Optional: `estimate(c) -> (context, remaining)`, a cheap belief (no lookup,
    no holds) used to skip a candidate that cannot get n_min tokens before `locate` is paid for."""

    block_size: int

    def locate(self, c: C) -> "tuple[int, int, Any] | None": ...

    def allocate(self, c: C, context: int, n: int) -> bool: ...

    def release(self, c: C) -> None: ...


def _whole_pages(context: int, n: int, block_size: int) -> int:
    """The largest n' <= n with context + n' on a page boundary."""
    return (context + n) // block_size * block_size - context if n > 0 else 0


def _upper_bound(budget, context: int, remaining: int, left: int, block_size: int, short_last: bool) -> int:
    """Lines 10 and 12 on a belief, before line 11 is read (no free-KV scan, no lookup): 0 when the
    candidate cannot get a chunk now."""
    k = min(remaining, left, budget.fits(context))
    if short_last and remaining < budget.n_min:
        return remaining if remaining <= k else 0
    k = _whole_pages(context, k, block_size)
    return k if k >= budget.n_min else 0


def chunk_size(budget, context: int, remaining: int, left: int, block_size: int, *, reload=None,
               probe: bool = False, short_last: bool = True) -> int:
    """Lines 10-12 for one candidate: the tokens it may add now (0: none). `left`: the host's allowance
    still unspent (already bounded by `budget.room()`)."""
    if remaining <= 0 or left <= 0:
        return 0
    n_min = budget.n_min
    if probe:                                                   # n_min at most, whatever t̂ says
        k = min(left, n_min, budget.read_kv_room(block_size))
        return remaining if remaining <= k else _whole_pages(context, k, block_size)
    k = min(remaining, left, budget.read_kv_room(block_size),                              # line 11
            budget.fits(context, reload=reload))                                            # line 10
    if short_last and remaining < n_min:                        # a last chunk may be short if all of it fits
        return remaining if remaining <= k else 0
    k = _whole_pages(context, k, block_size)
    return k if k >= n_min else 0                                                           # line 12


def spend_budget(budget, candidates: Sequence[C], host: SpendHost, *, limit: int | None = None,
                 probe: bool = False, short_last: bool = True) -> list[tuple[C, int, int]]:
    """Line 15: chunks for `candidates` (in the given order) within `budget`; returns `(candidate, context,
    n)` per chunk taken, after `host.allocate` accepted it and `budget.take` charged it.

    `limit`: at most this many tokens in all (None: the budget alone decides). `probe`: take one chunk of at
    most n_min tokens, whatever t̂ says (a host whose t̂ is not calibrated yet). `short_last`: a chunk that
    completes a candidate may be shorter than n_min (requests that must finish); False for streamed shadow
    jobs, whose short tail waits for more history (appendix C: each chunk re-reads the whole context),
    and then the walk stops as soon as no chunk of n_min fresh tokens fits any more (`budget.open`)."""
    if not isinstance(block_size := getattr(host, "block_size", None), int) or block_size <= 0:
        raise ValueError(f"host.block_size must be a positive int, got {block_size!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
        raise TypeError(f"limit must be an int or None, got {type(limit).__name__}")
    taken: list[tuple[C, int, int]] = []
    n_min = budget.n_min
    smallest = 1 if short_last or probe else n_min
    if not short_last and not probe and not budget.open:
        return taken
    estimate = getattr(host, "estimate", None)
    total = 0

    def left() -> int:
        return budget.room() if limit is None else min(limit - total, budget.room())

    for c in candidates:
        if left() < smallest or (probe and taken):
            break
        if estimate is not None and not probe:                  # skip before paying for a lookup
            ctx0, rest0 = estimate(c)
            if _upper_bound(budget, ctx0, rest0, left(), block_size, short_last) == 0:
                continue
            if not short_last and budget.read_kv_room(block_size) < n_min:                  # line 11
                break
        located = host.locate(c)
        if located is None:
            continue
        context, remaining, reload = located
        n = chunk_size(budget, context, remaining, left(), block_size, reload=reload, probe=probe,
                       short_last=short_last)
        if n <= 0 or not host.allocate(c, context, n):                                     # lines 11-12
            host.release(c)
            continue
        budget.take(n, context, reload=reload)
        taken.append((c, context, n))
        total += n
        if not short_last and not probe and not budget.open:   # b is spent: no chunk of n_min fits
            break
    return taken
