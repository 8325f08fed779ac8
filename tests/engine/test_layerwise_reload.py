"""Layer-wise reload through the real forward (issue 15), on CPU where the side stream runs in order, on
demand: a prefill whose prefix comes back from the host tier waits on layer l's copy just before layer l's
attention. Checked with the debug recorder (kv.reload.record_reloads, plus every paged_attention call logged
as a read of its layer): no layer is read before its copy, and later layers are copied only after earlier
layers computed (the pipeline). Outputs are compared exactly with the same forward over the prefix resident
and closely with the dense float32 reference; device pages are poisoned (NaN) so a read before the copy
shows. Reload-ahead: a waiting request the next iteration admits has its reload issued one step early."""
import math
import random

import pytest
import torch

from shadowprefill import ops
from shadowprefill.engine.config import EngineConfig
from shadowprefill.engine.llm_engine import LLMEngine
from shadowprefill.kv.host_tier import HostTier
from shadowprefill.kv.manager import KVCacheManager
from shadowprefill.kv.reload import ReloadBatch, record_reloads
from shadowprefill.model.config import ModelConfig
from shadowprefill.model.forward_batch import ForwardBatch
from shadowprefill.model.llama import Llama

from .conftest import assert_greedy_equal

BS = 16
LAYERS = 4


@pytest.fixture(scope="module")
def model():
    return Llama(ModelConfig.tiny(num_layers=LAYERS), seed=3)


def log_reads(monkeypatch, log):
    """Log every paged_attention call as ("read", None, layer) into `log` (the recorder's list)."""
    attention = ops.paged_attention

    def logged(q, kv_cache, layer, *args, **kwargs):
        log.append(("read", None, layer))
        return attention(q, kv_cache, layer, *args, **kwargs)

    monkeypatch.setattr(ops, "paged_attention", logged)


def forward(model, cache, tokens, cached, table, kv_ready=()):
    fb = ForwardBatch.from_sequences([tokens], [cached], [table], BS, logits="all", kv_ready=kv_ready)
    return model.forward(fb, cache)


def reloaded_prefix(model, prefix, num_blocks=12):
    """A pool whose `prefix` (whole pages) was prefilled, then spilled to the host; every free device page
    poisoned. Returns (pool, cache)."""
    spec = model.kv_spec(BS)
    cache = spec.allocate(num_blocks)
    pool = KVCacheManager(num_blocks, BS, kv_cache=cache, host_tier=HostTier(32, spec=spec, pin_memory=False))
    ids = pool.allocate(len(prefix) // BS, now=0)
    forward(model, cache, prefix, 0, ids)
    pool.commit(ids, prefix, now=0)
    pool.free(ids, now=0)
    return pool, cache


def spill_all(pool, cache, now):
    hold = pool.allocate(pool.num_blocks, now=now)
    assert hold is not None
    cache[hold] = float("nan")
    pool.free(hold, now=now)


def check_pipelined(log, batch_id):
    """No layer read before its copy arrived (and the forward waited on it); layer l+1 copied only after
    layer l was read: the copies ran layer by layer under the forward, not all before it."""
    at = {e: i for i, e in enumerate(log)}
    reads = [i for i, e in enumerate(log) if e[0] == "read"]
    assert [log[i][2] for i in reads] == list(range(LAYERS))
    for layer, read in enumerate(reads):
        assert at.get(("copy", batch_id, layer), math.inf) < at.get(("wait", batch_id, layer), math.inf) < read
        if layer + 1 < LAYERS:
            assert read < at.get(("copy", batch_id, layer + 1), -1)


@pytest.mark.parametrize("waits", [True, False])
def test_forward_waits_on_each_layer_just_before_its_attention(model, monkeypatch, waits):
    """Exact against the same forward with the prefix resident; the recorder shows each layer's wait
    between its copy and its read. Without the waits (kv_ready left out) the reads come first and the
    outputs are NaN: the checks can fail."""
    rng = random.Random(0)
    prompt = [rng.randrange(512) for _ in range(4 * BS + 9)]
    prefix, suffix = prompt[:4 * BS], prompt[4 * BS:]
    pool, cache = reloaded_prefix(model, prefix)
    m = pool.match_prefix(prompt, now=1, max_tokens=len(prefix))        # resident: the same forward
    tail = pool.allocate(1, now=1)
    resident = forward(model, cache, suffix, len(prefix), m.block_ids + tail)
    pool.free(m.block_ids + tail, now=1)
    spill_all(pool, cache, now=2)
    assert pool.peek_prefix(prefix) == (0, len(prefix))
    with record_reloads() as log:
        log_reads(monkeypatch, log)
        m = pool.match_prefix(prompt, now=3, max_tokens=len(prefix))
        batch = m.ready_event
        assert isinstance(batch, ReloadBatch) and m.host_tokens == len(prefix)
        assert cache[m.block_ids].isnan().all()
        pool.start_reloads()
        tail = pool.allocate(1, now=3)
        out = forward(model, cache, suffix, len(prefix), m.block_ids + tail, kv_ready=(batch,) if waits else ())
    assert log[0] == ("issue", batch.id, None)
    if not waits:
        assert not any(e[0] == "copy" for e in log) and out.isnan().all()
        with pytest.raises(AssertionError):
            check_pipelined(log, batch.id)
        return
    check_pipelined(log, batch.id)
    assert torch.equal(out, resident)                                  # exact: the same ops on the same bytes
    torch.testing.assert_close(out, model.reference_logits(prompt)[len(prefix):], rtol=1e-4, atol=1e-4)


def host_engine(model, token_budget):
    """An engine whose first request's prompt went to the host tier (all its device pages reused)."""
    host = HostTier(num_pages=64, spec=model.kv_spec(BS), pin_memory=False)
    engine = LLMEngine(model, EngineConfig(num_blocks=12, token_budget=token_budget), host_tier=host)
    return engine


def run(engine, steps=2000):
    outs = {}
    for _ in range(steps):
        if not engine.has_work():
            return outs
        for o in engine.step():
            outs[o.request_id] = o
    raise AssertionError("engine did not finish")


def test_engine_admission_reload_is_layer_wise_and_exact(model, monkeypatch):
    rng = random.Random(2)
    engine = host_engine(model, token_budget=64)
    first = [rng.randrange(512) for _ in range(70)]
    engine.add_request("a", first, 3)
    out_a = run(engine)["a"]
    for i in range(3):                                          # other traffic evicts a's pages to the host
        engine.add_request(f"x{i}", [rng.randrange(512) for _ in range(150)], 2)
        run(engine)
    second = first + out_a.token_ids + [rng.randrange(512) for _ in range(9)]
    assert engine.cached_prefix_tokens(second)[1] >= 4 * BS
    with record_reloads() as log:
        log_reads(monkeypatch, log)
        r = engine.add_request("b", second, 6)
        it = engine.schedule_step()
        batch_id = log[0][1]
        check_pipelined(log, batch_id)                          # the admission's reload, waited layer by layer
        engine.clock.advance(it.duration)
        engine.complete_step(it)
        out_b = run(engine)["b"]
    assert r.num_host_cached_tokens >= 4 * BS
    assert_greedy_equal(model, second, out_b.token_ids)


def test_reload_ahead_is_issued_the_step_before_admission(model, monkeypatch):
    rng = random.Random(4)
    engine = host_engine(model, token_budget=64)
    first = [rng.randrange(512) for _ in range(70)]
    engine.add_request("a", first, 2)
    run(engine)
    for i in range(3):
        engine.add_request(f"x{i}", [rng.randrange(512) for _ in range(150)], 2)
        run(engine)
    assert engine.cached_prefix_tokens(first) == (0, 4 * BS)
    with record_reloads() as log:
        log_reads(monkeypatch, log)
        engine.add_request("long", [rng.randrange(512) for _ in range(80)], 2)   # the whole first budget
        b = engine.add_request("b", first + [rng.randrange(512) for _ in range(20)], 5)
        steps, outs, admitted_at = [], {}, None
        while engine.has_work():
            steps.append(len(log))
            for o in engine.step():
                outs[o.request_id] = o
            if b.admitted and admitted_at is None:
                admitted_at = len(steps) - 1
    issue = next(i for i, e in enumerate(log) if e[0] == "issue")
    batch_id = log[issue][1]
    assert admitted_at == 1 and steps[0] <= issue < steps[1]     # issued in step 0, admitted in step 1
    assert b.num_host_cached_tokens == 4 * BS and b.num_cached_tokens == 4 * BS
    copies = [i for i, e in enumerate(log) if e[0] == "copy" and e[1] == batch_id]
    first_read = next(i for i in range(steps[1], len(log)) if log[i][0] == "read")
    assert len(copies) == LAYERS and all(issue < c < first_read for c in copies)   # none read before its copy
    assert_greedy_equal(model, b.prompt_token_ids, outs["b"].token_ids)
