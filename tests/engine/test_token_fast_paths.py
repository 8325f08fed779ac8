"""The C-level fast paths for plain-int token lists (shadow.jobs.check_token_ids, SimulatedExecutor's sampled
tokens) against an independent per-element reference, on random lists mixing plain ints, bools, negative
ints, floats, numpy ints and int subclasses."""
from __future__ import annotations

import enum
import random

import numpy as np
import pytest

from shadowprefill.engine.executor import SimulatedExecutor
from shadowprefill.model.latency import LatencyModel
from shadowprefill.engine.scheduler import ScheduledBatch
from shadowprefill.shadow.jobs import check_token_ids


class _Tok(enum.IntEnum):     # an int subclass that is not bool: a valid token id
    A = 3


def _reference_ok(tokens) -> bool:
    """Valid iff every element is an int (bool excluded) >= 0, checked one by one."""
    for t in tokens:
        if type(t) is bool or not isinstance(t, int) or t < 0:
            return False
    return True


_ODD = (True, False, -1, -7, 2.0, np.int64(5), _Tok.A, "4", None)


@pytest.mark.parametrize("seed", range(40))
def test_check_token_ids_matches_reference(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(0, 1 << 20) for _ in range(rng.randrange(0, 300))]
    for _ in range(rng.choice((0, 0, 1, 2))):     # most lists are clean; some carry odd elements
        tokens.insert(rng.randrange(len(tokens) + 1), rng.choice(_ODD))
    if _reference_ok(tokens):
        out = check_token_ids("prompt_token_ids", tokens)
        assert out == tokens and out is not tokens            # a copy, same values
    else:
        with pytest.raises(ValueError, match="prompt_token_ids"):
            check_token_ids("prompt_token_ids", tuple(tokens))


def test_check_token_ids_types():
    assert check_token_ids("t", []) == []
    assert check_token_ids("t", range(5)) == [0, 1, 2, 3, 4]
    for bad in ("abc", b"ab", 7):
        with pytest.raises(TypeError, match="t must be a sequence"):
            check_token_ids("t", bad)


class _Req:
    def __init__(self, i: int) -> None:
        self.i = i


@pytest.mark.parametrize("kind", ["int", "numpy", "bool", "mixed"])
def test_simulated_executor_returns_plain_ints(kind):
    rng = random.Random(len(kind))
    values = [rng.randrange(1, 50_000) for _ in range(64)]
    make = {"int": int, "numpy": np.int64, "bool": lambda v: bool(v % 2),
            "mixed": lambda v: (int, np.int32, _Tok, lambda x: bool(x % 2))[v % 4](v if v % 4 != 2 else 3)}[kind]
    reqs = [_Req(i) for i in range(len(values))]
    batch = ScheduledBatch(0.0)
    batch.samples.extend(reqs)
    ex = SimulatedExecutor(LatencyModel("Llama-3.1-8B"), token_fn=lambda r: make(values[r.i]))
    tokens = ex.execute(batch).tokens
    expect = [int(make(v)) for v in values]                     # independent: convert each one
    assert tokens == expect
    assert all(type(t) is int for t in tokens)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint16, np.uint32, np.int8])
def test_check_token_ids_numpy_arrays(dtype):
    rng = np.random.default_rng(7)
    arr = rng.integers(0, np.iinfo(dtype).max, size=257).astype(dtype)
    out = check_token_ids("prompt_token_ids", arr)
    assert out == [int(v) for v in arr] and all(type(t) is int for t in out)   # independent: one by one
    if np.issubdtype(dtype, np.signedinteger):
        arr[100] = -1
        with pytest.raises(ValueError, match="prompt_token_ids"):
            check_token_ids("prompt_token_ids", arr)
    assert check_token_ids("t", np.zeros(0, dtype=dtype)) == []


@pytest.mark.parametrize("bad", [np.ones(4, dtype=np.float32), np.ones(4, dtype=bool), np.ones((2, 2), dtype=np.int32)],
                         ids=["float", "bool", "2-D"])
def test_check_token_ids_refuses_other_arrays(bad):
    with pytest.raises(ValueError, match="prompt_token_ids"):
        check_token_ids("prompt_token_ids", bad)
