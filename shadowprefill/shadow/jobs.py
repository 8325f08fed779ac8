"""Shadow-job rules of paper §3.1, engine-free (DESIGN.md §6).

A shadow job is one session's history as this engine's model should hold it. In the engine it is a request
of the lowest class in the scheduler's queue whose prompt grows (`engine.shadow_work.ShadowRequest`); this
module holds the rules such a job follows whatever holds it:

- `supersede`: a newer history replaces the old one; an extension keeps all progress, a history that is
  not append-only keeps only the whole pages of the longest common prefix (`common_prefix_length`), and
  pending work of the old history is dropped (newer history supersedes it);
- `check_token_ids` / `check_switch_prob`: the inputs' validation.

Only whole pages are shadowed: a partial last page could not be registered in the prefix cache, so the
switch call prefills that tail itself, as it does the output of the current call (§3.1).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n                        # a[:lo] == b[:lo], a[:hi] != b[:hi]; bisect on slices (C speed)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class CheckedTokenIds(list):
    """A list of token ids that is valid by construction (non-negative Python ints: the workload
    generator's `cluster.workloads.token_list`), so `check_token_ids` copies it without a per-id check."""

    __slots__ = ()


def check_token_ids(name: str, token_ids) -> list[int]:
    """token_ids as a new list of non-negative Python ints: from a sequence of ints (bool and numpy scalars
    are refused) or a 1-D numpy array of an integer dtype (checked and converted in C)."""
    if token_ids.__class__ is CheckedTokenIds:
        return list(token_ids)
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1 or token_ids.dtype.kind not in "iu":
            raise ValueError(f"{name} must hold non-negative int token ids (got a {token_ids.ndim}-D "
                             f"{token_ids.dtype} array)")
        if token_ids.dtype.kind == "i" and token_ids.size and token_ids.min() < 0:
            raise ValueError(f"{name} must hold non-negative int token ids")
        return token_ids.tolist()
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__len__"):
        raise TypeError(f"{name} must be a sequence of ints, got {type(token_ids).__name__}")
    tokens = list(token_ids)
    if {*map(type, tokens)} <= {int}:     # plain ints (the common case): two C-level scans, no Python loop
        bad = bool(tokens) and min(tokens) < 0
    else:
        bad = any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in tokens)
    if bad:
        raise ValueError(f"{name} must hold non-negative int token ids")
    return tokens


def check_switch_prob(switch_prob) -> float:
    """switch_prob as a float in [0, 1] (TypeError / ValueError naming it otherwise)."""
    if isinstance(switch_prob, bool) or not isinstance(switch_prob, (int, float)) or math.isnan(switch_prob):
        raise TypeError(f"switch_prob must be a number in [0, 1], got {switch_prob!r}")
    if not 0.0 <= switch_prob <= 1.0:
        raise ValueError(f"switch_prob must be in [0, 1], got {switch_prob}")
    return float(switch_prob)


def supersede(old: list[int], new: list[int], num_cached: int, block_size: int) -> tuple[int, int, bool]:
    """A newer history `new` replaces `old`, of which `num_cached` (page-aligned) tokens are cached:
    returns (tokens whose page hashes stay valid, num_cached after, whether `new` rewrote `old`). An
    extension keeps all progress; otherwise only the whole pages of the longest common prefix stay cached
    (non-append-only histories, e.g. a compacted context)."""
    if len(new) >= len(old) and new[:len(old)] == old:
        return len(old), num_cached, False
    lcp = common_prefix_length(old, new)
    return lcp, min(num_cached, lcp // block_size * block_size), True
