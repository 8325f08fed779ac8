"""Counted tokens and non-streamed requests (the simulator's fast path) against the per-token path.

A SimulatedExecutor without a token_fn samples nothing: each request counts its new tokens (its replayed
output, then the executor's filler) and fills its token list in only where tokens are read. The reference
is the same engine whose executor samples the filler explicitly (`token_fn`), so every token is appended
one by one: both must produce the same tokens, timings, finishes, preemptions and the same KV pool (page
hashes, LRU order, free list), on random workloads, with preemption and with an EOS token. A request added
with stream=False reports only its final output, which must equal the streamed one's last output.
"""
import random

import pytest

from shadowprefill.engine.config import EngineConfig
from shadowprefill.engine.executor import SimulatedExecutor
from shadowprefill.engine.llm_engine import LLMEngine
from shadowprefill.engine.request import Priority, Request
from shadowprefill.kv.page_hash import page_hashes, pool_salt

FILL = 7
BS = 16


class LinearLatency:
    def iteration_time(self, prefill, decode_contexts):
        return 2e-3 + 2e-5 * sum(n for n, _ in prefill) + 1e-4 * len(decode_contexts) + 1e-8 * sum(decode_contexts)


def make(counted: bool, num_blocks=4096, **cfg):
    ex = SimulatedExecutor(LinearLatency(), filler_token=FILL) if counted else \
        SimulatedExecutor(LinearLatency(), token_fn=lambda r: FILL)
    return LLMEngine(ex, EngineConfig(num_blocks=num_blocks, shadow_mode="none", tpot_slo_s=0.05, **cfg))


def workload(seed, n=24, eos=None):
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(10, 500) for _ in range(rng.randrange(1, 120))]
        max_tokens = rng.randrange(1, 90)
        replay = None
        if rng.random() < 0.5:                                   # a recorded output, maybe shorter than max
            replay = [rng.randrange(10, 500) for _ in range(rng.randrange(0, max_tokens + 5))]
            if eos is not None and replay and rng.random() < 0.5:
                replay[rng.randrange(len(replay))] = eos
        reqs.append((f"r{i}", prompt, max_tokens, rng.choice(("routed", "normal")), replay,
                     rng.random() < 0.5, rng.randrange(0, 4)))
    return reqs


def run(engines, reqs, expected):
    """Drive the engines in lockstep, adding the requests over the first iterations; after every step their
    KV pools must agree page by page (hashes, references, LRU order, free list). Returns, per engine, every
    output seen per request and the requests."""
    pending = list(reqs)
    seen = [{} for _ in engines]
    handles = [{} for _ in engines]
    step = 0
    while pending or any(e.has_work() for e in engines):
        while pending and pending[0][6] <= step:
            rid, prompt, max_tokens, prio, replay, stream, _ = pending.pop(0)
            for e, h in zip(engines, handles):
                h[rid] = e.add_request(rid, list(prompt), max_tokens, priority=prio, output_token_ids=replay,
                                       stream=stream)
        for e, got in zip(engines, seen):
            for out in e.step():
                got.setdefault(out.request_id, []).append(
                    (out.token_ids, out.finished, out.first_token_time, out.finish_time, out.finish_reason,
                     out.num_output_tokens, out.new_token_id))
        first = engines[0].kv.snapshot()
        assert all(e.kv.snapshot() == first for e in engines[1:]), f"pools differ after step {step}"
        for e in engines:                          # every full computed page is registered, with its hash
            for r in e.scheduler.running:
                full = r.num_computed_tokens // BS
                tokens = r.prompt_token_ids + expected[r.request_id][:r.num_output_tokens]   # (not the request's)
                assert [e.kv.block_hash(b) for b in r.block_ids[:full]] == page_hashes(tokens[:full * BS], BS,
                                                                                       pool_salt("", ""))
        step += 1
        assert step < 100_000
    return seen, handles


def expected_output(prompt_replay, max_tokens, eos):
    replay = prompt_replay or []
    out = (list(replay) + [FILL] * max_tokens)[:max_tokens]
    if eos is not None and eos in out:
        out = out[:out.index(eos) + 1]
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_blocks,eos", [(1024, None), (40, None), (1024, 13), (48, 13)],
                         ids=["roomy", "preempting", "eos", "eos-preempting"])
def test_counted_tokens_match_per_token_path(seed, num_blocks, eos):
    reqs = workload(seed, eos=eos)
    if eos is not None:
        reqs = [(rid, [t if t != eos else eos + 1 for t in p], m, pr, rp, st, at) for rid, p, m, pr, rp, st, at in reqs]
    counted, per_token = make(True, num_blocks, eos_token_id=eos), make(False, num_blocks, eos_token_id=eos)
    expected = {rid: expected_output(replay, m, eos) for rid, _, m, _, replay, _, _ in reqs}
    (got, want), (got_req, want_req) = run([counted, per_token], reqs, expected)
    for rid, prompt, max_tokens, _, replay, stream, _ in reqs:
        final = got[rid][-1]
        assert final[1] and final == want[rid][-1]                 # same tokens, times, reason
        assert final[0] == expected[rid]                           # independent of both engines
        assert got_req[rid].all_token_ids == prompt + final[0] == want_req[rid].all_token_ids
        assert got_req[rid].output_token_ids == final[0]
        if stream:
            assert got[rid] == want[rid]                           # every streamed output the same
        else:
            assert len(got[rid]) == 1                              # only the final one
    assert counted.stats.as_dict() == per_token.stats.as_dict()
    if num_blocks < 100:
        assert counted.stats.preemptions > 0                       # the small pools do preempt


def test_non_streamed_request_reports_only_its_final_output():
    e = make(True)
    e.add_request("quiet", list(range(10, 40)), 12, stream=False)
    e.add_request("loud", list(range(10, 40)), 12)
    outs = []
    while e.has_work():
        outs += e.step()
    quiet = [o for o in outs if o.request_id == "quiet"]
    loud = [o for o in outs if o.request_id == "loud"]
    assert len(quiet) == 1 and len(loud) == 12
    q, l_last = quiet[0], loud[-1]
    assert q.finished and q.token_ids == [FILL] * 12 == l_last.token_ids
    assert (q.first_token_time, q.finish_time, q.num_output_tokens) == \
        (l_last.first_token_time, l_last.finish_time, 12)


def test_request_token_materialisation():
    """token_ids_upto fills in replay then fill tokens; a request without a fill token refuses counted ones."""
    r = Request("x", [1, 2, 3], 10, Priority.NORMAL, 0.0, 0, replay_token_ids=[4, 5], fill_token=9)
    r.num_tokens += 4                                              # four counted tokens
    assert r.token_ids_upto(4) == [1, 2, 3, 4]                     # only what was asked
    assert r.all_token_ids == [1, 2, 3, 4, 5, 9, 9]
    assert r.output_token_ids == [4, 5, 9, 9] and r.num_output_tokens == 4 and r.num_remaining == 7
    assert r.append_token(100) == 100 and r.all_token_ids[-1] == 100   # past the replay: the sampled one
    assert r.prompt_token_ids == [1, 2, 3]
    q = Request("y", [1], 5, Priority.NORMAL, 0.0, 0)
    q.num_tokens += 1
    with pytest.raises(RuntimeError, match="fill_token"):
        q.all_token_ids
