"""The vLLM version gate's checker, on stand-in modules (runs without vLLM; the real vLLM is checked by
tests/vllm_harness/conformance.py in the vLLM venv)."""
import sys
import types

import pytest

from shadowprefill.integrations.vllm import compat


class Base:
    def __init__(self):
        self.held = 1

    def step(self, output, runner_output, extra=None) -> "tuple[Blocks, int, int]":
        return None


class Thing(Base):
    limit = 3

    def __init__(self):
        super().__init__()
        self.queue: list = []


@pytest.fixture
def fake_module(monkeypatch):
    mod = types.ModuleType("fake_vllm_internals")
    mod.Thing = Thing
    monkeypatch.setitem(sys.modules, "fake_vllm_internals", mod)
    return mod


def test_present_members_pass(fake_module):
    spec = {"fake_vllm_internals": {"Thing": ["limit", "queue", "held", "step(output, runner_output)",
                                             "step(output) -> tuple[Blocks, int, int]"]}}
    assert compat.problems(spec) == []
    assert compat.require(spec)                     # returns the vLLM version string (whatever is installed)


def test_missing_and_changed_members_are_all_named_in_one_message(fake_module):
    spec = {"fake_vllm_internals": {"Thing": ["queue", "gone", "step(runner_output, output)", "limit(x)",
                                             "step(output) -> tuple[Blocks, int]"],
                                    "Absent": ["x"]},
            "no_such_module_xyz": {"A": ["b"]}}
    got = compat.problems(spec)
    assert len(got) == 6, got
    joined = "\n".join(got)
    for part in ("Thing.gone (missing)", "parameter 'output' missing or moved", "limit (not callable)",
                 "returns tuple[Blocks, int, int], expected tuple[Blocks, int]", "Absent (missing)",
                 "no_such_module_xyz (cannot import"):
        assert part in joined, part
    with pytest.raises(compat.VLLMVersionError) as e:
        compat.require(spec)
    msg = str(e.value)
    assert compat.SUPPORTED in msg and "6 internal(s)" in msg and "Thing.gone (missing)" in msg
    assert isinstance(e.value, ImportError)         # vLLM reports the scheduler class as not loadable


def test_supported_range():
    assert compat._in_range("0.31.0") and compat._in_range("0.32.0+cpu") and compat._in_range("0.32.1")
    assert not compat._in_range("0.30.0") and not compat._in_range("0.33.0") and not compat._in_range("unknown")


def test_the_required_table_names_what_the_plugin_reads():
    """Every vLLM class the plugin imports or subclasses is in the table (the scheduler imports nothing else)."""
    names = {f"{m}.{c}" for m, objs in compat.REQUIRED.items() for c in objs}
    for want in ("vllm.v1.core.sched.scheduler.Scheduler", "vllm.v1.core.sched.async_scheduler.AsyncScheduler",
                 "vllm.v1.core.kv_cache_manager.KVCacheManager", "vllm.v1.core.block_pool.BlockPool",
                 "vllm.v1.request.Request", "vllm.v1.core.sched.output.NewRequestData"):
        assert want in names
