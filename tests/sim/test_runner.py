"""map_jobs: results in input order whether jobs run serially, in a fork pool or as Ray tasks (here a
stand-in `ray` module that completes tasks in reverse order; tests/ray_harness runs the real one)."""
import sys
import time
import types

import pytest

from shadowprefill.sim.runner import map_jobs


def square_plus(item):
    x, k = item
    return x * x + k


def slow_first(item):
    """Earlier items take longer, so a pool finishes them last."""
    time.sleep(0.1 * (7 - item[1]))
    return square_plus(item)


ITEMS = [(x, k) for x, k in zip([3, -1, 7, 0, 5, 2], [1, 2, 3, 4, 5, 6])]
WANT = [x * x + k for x, k in ITEMS]


def test_serial_and_pool_keep_input_order():
    assert map_jobs(square_plus, ITEMS, jobs=1, progress=False) == WANT
    assert map_jobs(square_plus, ITEMS, jobs=3, progress=False) == WANT
    assert map_jobs(slow_first, ITEMS, jobs=3, progress=False) == WANT
    assert map_jobs(square_plus, [], jobs=2, progress=False) == []
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="jobs"):
            map_jobs(square_plus, ITEMS, jobs=bad)


class FakeRay(types.ModuleType):
    """The part of Ray's API that map_jobs uses; `wait` hands back the most recently submitted task first."""

    def __init__(self, initialized=False):
        super().__init__("ray")
        self.initialized, self.inits, self.shutdowns, self.waits = initialized, [], 0, 0
        self.options = None

    def is_initialized(self):
        return self.initialized

    def init(self, address=None, **kwargs):
        self.initialized = True
        self.inits.append(address)

    def shutdown(self):
        self.initialized = False
        self.shutdowns += 1

    def remote(self, **options):
        self.options = options
        ray = self

        class Remote:
            def __init__(self, fn):
                self.fn = fn

            def remote(self, item):
                assert ray.initialized
                return ("ref", item, self.fn)

        return Remote

    def wait(self, pending, num_returns=1):
        self.waits += 1
        return pending[-num_returns:], pending[:-num_returns]

    def get(self, ref):
        _, item, fn = ref
        return fn(item)


@pytest.mark.parametrize("initialized", [False, True])
def test_ray_tasks_come_back_in_input_order(monkeypatch, initialized, capsys):
    fake = FakeRay(initialized)
    monkeypatch.setitem(sys.modules, "ray", fake)
    got = map_jobs(square_plus, ITEMS, ray=True, ray_address="ray://head:10001" if not initialized else None,
                   desc="points")
    assert got == WANT and fake.waits == len(ITEMS) and fake.options == {"num_cpus": 1}
    if initialized:          # a caller's Ray session is used and left alone
        assert fake.inits == [] and fake.shutdowns == 0
    else:                    # connected for this call only
        assert fake.inits == ["ray://head:10001"] and fake.shutdowns == 1
    assert "points (ray)" in capsys.readouterr().err           # the progress bar
