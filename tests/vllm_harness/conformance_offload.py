"""The host tier with ShadowScheduler, model-free: vLLM's real `OffloadingConnector` scheduler side (CPU
offloading spec) under the plugin, its worker side replaced by a recording worker.

    .venv-vllm/bin/python -m pytest -q tests/vllm_harness/conformance_offload.py      (run.sh runs it)

vLLM's offload worker copies KV between GPU and host memory on CUDA streams; there is no GPU here. The
recording worker does what that worker tells the scheduler (`OffloadingWorkerMetadata.completed_jobs`, and
`finished_recving` for loads) on the schedule the real one follows (stores issued by step k are submitted
at the start of step k+1 and finish after its forward pass, unless the scheduler flushes them; loads
finish after their step), and it keeps an independent model of what every GPU and host block holds: a
block holds the prompt prefix that was computed into it (KV at a position depends on all tokens before
it), stores copy GPU blocks to host blocks, loads copy back. Every scheduled request must read, in the
blocks of its block table, exactly its own prompt's prefix up to its computed tokens; a load that put the
wrong host block in, a store that copied a block after it was reused, or a shadow chunk the connector did
not see would show up as a wrong read.

Checked, sync and async scheduling, V1 and V2 runner settings: with no shadows every `SchedulerOutput` and
the connector's metadata (store and load jobs, flushes) equal stock vLLM's step for step; with shadows,
the conformance invariants of conformance.py hold and every read is right; the connector's store jobs
name a shadow's blocks in the step whose chunk computed them; a switch call with the shadow's prefix,
after the GPU prefix cache lost it, is served by a host-tier load of the shadow's blocks; a shadow whose
prefix is only on the host is admitted through the connector's lookup, waits in WAITING_FOR_REMOTE_KVS
for its load, then computes the rest in budgeted chunks. Another connector is refused at start-up.
"""
from __future__ import annotations

import json
import random

import pytest

from conformance import (BS, MODES, NORMAL, NUM_BLOCKS, ROUTED, SHADOW, Driver, make, model_dir,  # noqa: F401
                         normalized, script)
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from shadowprefill.integrations.vllm.scheduler import ShadowScheduler

CPU_BLOCKS = 256            # host tier: 4x the GPU pool (one 4 KiB page per block in these configs)


def offload_config(cpu_blocks: int = CPU_BLOCKS, connector: str = "OffloadingConnector") -> KVTransferConfig:
    return KVTransferConfig(kv_connector=connector, kv_role="kv_both",
                            kv_connector_extra_config={"cpu_bytes_to_use": cpu_blocks * 4096})


class RecordingWorker:
    """The offloading connector's worker side, as the scheduler sees it, over a model of block contents."""

    def __init__(self, sched) -> None:
        self.s = sched
        self.gpu: dict[int, tuple] = {}         # GPU block -> the prompt prefix computed into it
        self.cpu: dict[int, tuple] = {}         # host block -> copied content
        self.unsubmitted: list = []             # store jobs issued by the previous step (vLLM defers them)
        self.steps = 0
        self.snap: dict[int, list] = {}         # id(SchedulerOutput) -> what each request reads and writes
        self.stores: list[tuple[int, str, list[int]]] = []    # (step, request, GPU blocks stored)
        self.loads: list[tuple[int, str, list[int]]] = []     # (step, request, GPU blocks loaded)
        self.bad: list[str] = []

    def scheduled(self, out) -> None:
        s, snap = self.s, []
        for rid, n in out.num_scheduled_tokens.items():
            r = s.requests[rid]
            snap.append((rid, list(s.kv_cache_manager.get_block_ids(rid)[0]), r.num_computed_tokens - n, n,
                         tuple(r.prompt_token_ids)))
        self.snap[id(out)] = (self.steps_scheduled(), snap)

    def steps_scheduled(self) -> int:
        self.steps += 1
        return self.steps

    def _copy(self, job, src: dict, dst: dict) -> None:
        for a, b in zip(job.src_spec.block_ids.tolist(), job.dst_spec.block_ids.tolist()):
            dst[b] = src.get(a)

    def execute(self, out) -> KVConnectorOutput:
        step, snap = self.snap.pop(id(out))
        meta = out.kv_connector_metadata
        done: dict[int, int] = {}
        flush = set(meta.jobs_to_flush or ())
        for jid in list(meta.store_jobs):               # handle_preemptions: flushed stores go out now
            if jid in flush:
                self.unsubmitted.append((jid, meta.store_jobs.pop(jid)))
        inflight, self.unsubmitted = self.unsubmitted, []
        for jid, job in inflight:
            if jid in flush:                            # the scheduler waits for these before the forward pass
                self._copy(job, self.gpu, self.cpu)
                done[jid] = 1
        for rid, blocks, c, n, prompt in snap:          # the forward pass: reads, then writes
            for i in range(-(-min(c, len(prompt)) // BS)):
                need = min((i + 1) * BS, c, len(prompt))
                got = self.gpu.get(blocks[i]) if i < len(blocks) else None
                if got is None or len(got) < need or got[:need] != prompt[:need]:
                    self.bad.append(f"step {step}: {rid} reads block {i} (id {blocks[i] if i < len(blocks) else None})"
                                    f" holding {None if got is None else len(got)} tokens of another prefix")
            end = min(c + n, len(prompt))
            for i in range(c // BS, -(-end // BS)):
                self.gpu[blocks[i]] = prompt[:min((i + 1) * BS, end)]
        for jid, job in inflight:                       # submitted stores finish after the forward pass
            if jid not in done:
                self._copy(job, self.gpu, self.cpu)
                done[jid] = 1
        recving = set()
        for jid, job in meta.load_jobs.items():
            self._copy(job, self.cpu, self.gpu)
            self.loads.append((step, job.req_id, job.dst_spec.block_ids.tolist()))
            done[jid] = 1
            recving.add(job.req_id)
        for jid, job in meta.store_jobs.items():        # wait_for_save: submitted at the next step's start
            self.stores.append((step, job.req_id, job.src_spec.block_ids.tolist()))
            self.unsubmitted.append((jid, job))
        meta_out = OffloadingWorkerMetadata(completed_jobs=done) if done else None
        return KVConnectorOutput(finished_recving=recving or None, kv_connector_worker_meta=meta_out)


def connector_meta(out) -> dict:
    m = out.kv_connector_metadata
    return {"load": sorted((j.req_id, j.dst_spec.block_ids.tolist()) for j in m.load_jobs.values()),
            "store": sorted((j.req_id, j.src_spec.block_ids.tolist()) for j in m.store_jobs.values()),
            "flush": len(m.jobs_to_flush or ())}


def run(sched, async_sched: bool, reqs) -> tuple[Driver, RecordingWorker]:
    w = RecordingWorker(sched)
    d = Driver(sched, async_sched, worker=w)
    d.run(reqs)
    assert not d.violations, d.violations[:5]
    assert not w.bad, w.bad[:5]
    return d, w


def evicting_script(seed: int, shadows: bool) -> list:
    """Sessions whose histories outgrow the 64-block GPU pool: later calls find their prefix on the host."""
    rng = random.Random(seed)
    out = script(seed, shadows)
    step = out[-1][0]
    hist = [[rng.randrange(10, 500) for _ in range(rng.randrange(200, 400))] for _ in range(3)]
    for i, h in enumerate(hist):
        step += 3
        if shadows:
            out.append((step, f"hs{i}", h, 1, SHADOW))
        out.append((step + 40, f"hc{i}", h + [rng.randrange(10, 500) for _ in range(20)], 4, ROUTED))
    return out


@pytest.mark.parametrize("async_sched,v2", MODES)
def test_without_shadows_outputs_and_connector_jobs_equal_stock_vllm(model_dir, monkeypatch, async_sched, v2):
    runs = []
    for cls in (AsyncScheduler if async_sched else Scheduler, ShadowScheduler):
        sched = make(cls, model_dir, async_sched, v2, monkeypatch, kv_transfer=offload_config())
        d, w = run(sched, async_sched, evicting_script(4, shadows=False))
        runs.append([(normalized(o), connector_meta(o)) for o in d.outputs])
        assert w.loads and w.stores                             # the script reaches the host tier
    stock, plugin = runs
    assert len(stock) == len(plugin)
    for i, (a, b) in enumerate(zip(stock, plugin)):
        assert a == b, f"step {i + 1} differs"


@pytest.mark.parametrize("async_sched,v2", MODES)
def test_with_shadows_invariants_and_reads_hold(model_dir, monkeypatch, tmp_path, async_sched, v2):
    stats = tmp_path / "steps.jsonl"
    sched = make(ShadowScheduler, model_dir, async_sched, v2, monkeypatch, stats_path=stats,
                 kv_transfer=offload_config())
    reqs = evicting_script(5, shadows=True)
    d, w = run(sched, async_sched, reqs)
    rows = [json.loads(x) for x in stats.read_text().splitlines()]
    assert sum(r["shadow_tokens"] for r in rows) > 0
    for r in rows:
        assert r["shadow_tokens"] <= r["budget_tokens"] and r["shadow_tokens"] <= max(r["chunk_limit"], BS), r
        assert r["shadow_tokens"] == 0 or r["waiting"] == 0, r
    assert all(d.finished[rid] == "length" for _, rid, _, _, prio in reqs if prio < SHADOW)
    shadow_ids = {rid for _, rid, _, _, prio in reqs if prio >= SHADOW}
    assert any(rid in shadow_ids for _, rid, _ in w.stores)          # shadow blocks went to the host tier
    assert any(rid.startswith("hc") for _, rid, _ in w.loads)         # switch calls came back from it


def _chunks(d, rid):
    """(step index, computed before, tokens) of each chunk of `rid`, from the driver's outputs."""
    out = []
    for i, o in enumerate(d.outputs):
        n = o.num_scheduled_tokens.get(rid)
        if n:
            new = [nr.num_computed_tokens for nr in o.scheduled_new_reqs if nr.req_id == rid]
            cached = o.scheduled_cached_reqs
            c = new[0] if new else cached.num_computed_tokens[cached.req_ids.index(rid)]
            out.append((i + 1, c, n))
    return out


@pytest.mark.parametrize("async_sched", [False, True])
def test_shadow_blocks_are_stored_and_a_switch_call_loads_them(model_dir, monkeypatch, async_sched):
    """A 20-block shadow runs in chunks; each chunk's full blocks are stored to the host in the step that
    computed them. Normal traffic then evicts the shadow's blocks from the GPU prefix cache; the switch call
    (routed, the shadow's history plus new tokens) is served by a host-tier load of those blocks."""
    sched = make(ShadowScheduler, model_dir, async_sched, False, monkeypatch, kv_transfer=offload_config())
    rng = random.Random(11)
    history = [rng.randrange(10, 500) for _ in range(20 * BS)]
    fillers = [(30 + 2 * i, f"f{i}", [rng.randrange(10, 500) for _ in range(12 * BS)], 2, NORMAL) for i in range(8)]
    reqs = [(0, "s", history, 1, SHADOW)] + fillers + [(60, "call", history + [3, 4, 5], 4, ROUTED)]
    d, w = run(sched, async_sched, reqs)
    assert d.finished == {rid: "length" for _, rid, _, _, _ in reqs}
    chunks = _chunks(d, "s")
    assert len(chunks) >= 3 and sum(n for _, _, n in chunks) == len(history)
    # each chunk's completed blocks are named by a store job of the shadow issued in that chunk's step
    stored = {}
    for step, rid, blocks in w.stores:
        if rid == "s":
            stored.setdefault(step, []).extend(blocks)
    for step, c, n in chunks:
        full = (c + n) // BS - c // BS
        assert len(stored.get(step, [])) == full, (step, c, n, stored.get(step))
    # the GPU prefix cache lost the shadow's prefix before the call; the call loaded it from the host
    call_loads = [(step, blocks) for step, rid, blocks in w.loads if rid == "call"]
    assert len(call_loads) == 1 and len(call_loads[0][1]) >= 16, call_loads
    first = next(o for o in d.outputs if "call" in o.num_scheduled_tokens)
    new = next(nr for nr in first.scheduled_new_reqs if nr.req_id == "call")
    assert new.num_computed_tokens == len(history)               # 20 whole blocks: local hit + host load
    assert new.num_computed_tokens - len(call_loads[0][1]) * BS < len(history)   # some came from the host


@pytest.mark.parametrize("async_sched", [False, True])
def test_a_shadow_with_its_prefix_on_the_host_loads_it_then_computes_in_chunks(model_dir, monkeypatch,
                                                                                 async_sched):
    """A session's earlier history is on the host only (stored, then evicted from the GPU by fillers); its
    next shadow is admitted through the connector's lookup: it waits in WAITING_FOR_REMOTE_KVS for the
    load, computes nothing while it waits, and then only the new part (budgets: the invariants test)."""
    sched = make(ShadowScheduler, model_dir, async_sched, False, monkeypatch, kv_transfer=offload_config())
    rng = random.Random(12)
    old = [rng.randrange(10, 500) for _ in range(16 * BS)]
    new_part = [rng.randrange(10, 500) for _ in range(6 * BS)]
    fillers = [(10 + 2 * i, f"f{i}", [rng.randrange(10, 500) for _ in range(12 * BS)], 2, NORMAL) for i in range(8)]
    statuses = []
    orig = sched.schedule

    def spy(*a, **k):
        out = orig(*a, **k)
        r = sched.requests.get("s2")
        statuses.append(None if r is None else r.status)
        return out
    sched.schedule = spy
    reqs = [(0, "first", old, 2, NORMAL)] + fillers + [(40, "s2", old + new_part, 1, SHADOW)]
    d, w = run(sched, async_sched, reqs)
    assert d.finished == {rid: "length" for _, rid, _, _, _ in reqs}
    loads = [blocks for _, rid, blocks in w.loads if rid == "s2"]
    assert len(loads) == 1 and len(loads[0]) >= 8, loads
    assert sched.totals["shadow_host_loads"] == 1
    parked = [i for i, st in enumerate(statuses) if st == RequestStatus.WAITING_FOR_REMOTE_KVS]
    assert parked and all("s2" not in d.outputs[i].num_scheduled_tokens for i in parked)
    chunks = _chunks(d, "s2")
    assert chunks[0][0] > parked[-1] and chunks[0][1] >= len(old) - BS    # after the load, past the prefix
    assert sum(n for _, _, n in chunks) == len(old) + len(new_part) - chunks[0][1]


def test_another_connector_is_refused(model_dir, monkeypatch):
    with pytest.raises(ValueError, match="OffloadingConnector only"):
        make(ShadowScheduler, model_dir, False, False, monkeypatch,
             kv_transfer=KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                                          kv_connector_extra_config={"shared_storage_path": "/tmp/sp-none"}))


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
