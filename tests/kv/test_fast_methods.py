"""The native manager's allocate / commit fast paths (csrc/kv/fast_calls.cpp) behave as the Python methods:
the same results, state and errors for common and unusual calls (those are passed on to the methods)."""
import pytest

from shadowprefill.kv.manager import KVCacheManager
from shadowprefill.kv.native import native_available

if not native_available():
    raise ImportError("shadowprefill._C_kv is not built")

BS = 2
CALLS = [
    ("allocate", (2,), {"now": 0.0}),
    ("allocate", (1,), {"now": 1, "shadow": True}),
    ("allocate", (0,), {"now": 1.0, "shadow": None}),
    ("allocate", (), {"n": 1, "now": 1.0}),
    ("allocate", (-1,), {"now": 1.0}),
    ("allocate", (1.0,), {"now": 1.0}),
    ("allocate", (True,), {"now": 1.0}),
    ("allocate", (1,), {}),
    ("allocate", (1,), {"now": "x"}),
    ("allocate", (1,), {"now": 0.5}),
    ("allocate", (1, 2.0), {}),
    ("allocate", (1,), {"now": 2.0, "bogus": 1}),
    ("allocate", (1,), {"now": 2.0, "shadow": "yes"}),
    ("commit", ([0, 1], [1, 2, 3, 4]), {"now": 2.0}),
    ("commit", ([0, 1], (1, 2, 3, 4, 5)), {"now": 2.0, "tenant": "t"}),
    ("commit", ([2], [5, 6, 7]), {"now": 2.0, "num_tokens": 2}),
    ("commit", ([2], [5, 6]), {"now": 2.0, "tenant": 3}),
    ("commit", ([2], [5, -6]), {"now": 2.0}),
    ("commit", ([99], [5, 6]), {"now": 2.0}),
    ("commit", ([2], [5, 6]), {}),
    ("commit", ([2], [5, 6]), {"now": 1.0}),
    ("commit", (), {"block_ids": [3], "token_ids": [1, 1], "now": 2.0}),
    ("commit", ([3], [1, 1]), {"now": 2.0, "hashes": 5}),
    ("commit", ([3], [1, 1], 2.0), {}),
]


def outcome(kv, name, args, kwargs):
    try:
        return getattr(kv, name)(*args, **kwargs)
    except (TypeError, ValueError) as e:
        return type(e), str(e)


def test_fast_methods_match_the_python_methods():
    fast = KVCacheManager(8, BS, model_id="m", backend="native")
    plain = KVCacheManager(8, BS, model_id="m", backend="native")
    assert "allocate" in vars(fast) and "commit" in vars(fast)
    del plain.allocate, plain.commit           # the class's Python methods
    for name, args, kwargs in CALLS:
        assert outcome(fast, name, args, kwargs) == outcome(plain, name, args, kwargs), (name, args, kwargs)
        assert fast.snapshot() == plain.snapshot() and fast.stats == plain.stats


def test_subclasses_keep_their_methods():
    class Counting(KVCacheManager):
        def allocate(self, n, *, now, shadow=False):
            return ["counted", super().allocate(n, now=now, shadow=shadow)]
    kv = Counting(4, BS, backend="native")
    assert kv.allocate(1, now=0.0) == ["counted", [0]]


def test_fast_methods_hold_no_reference_to_the_manager():
    import gc
    import weakref
    kv = KVCacheManager(4, BS, backend="native")
    allocate = kv.allocate
    ref = weakref.ref(kv)
    del kv
    assert ref() is None                        # freed without a collection (no cycle)
    with pytest.raises(ReferenceError):
        allocate(-1, now=0.0)
    gc.collect()
