"""The controller's budget against a hand computation of Algorithm 1 and Eq. 1 on constructed batches:
every branch (waiting queue / blocked admission, idle, routed credit, SLO slack of decodes and of
prefilling requests), the KV cap (line 11), n_min (line 12), job order (line 15), credit accrual.

The controller reads only an `IterationView`; `Harness` puts the controller in a real `LLMEngine` and runs the
engine's own shadow phase (`Scheduler.schedule`'s last phase: plan, then spend_budget on the engine's jobs) and
postprocess on hand-built batches, so the tests check the engine's wiring too."""
import math
from typing import NamedTuple

import pytest

from shadowprefill.engine import LLMEngine, SimulatedExecutor
from shadowprefill.engine.config import EngineConfig
from shadowprefill.engine.request import Priority, Request, RequestStatus
from shadowprefill.engine.scheduler import ScheduledBatch
from shadowprefill.shadow.controller import LIVENESS_S, ShadowController, default_tpot_slo, default_ttft_slo
from shadowprefill.engine.shadow_work import ShadowQueue
from shadowprefill.shadow.predictor import IterationPredictor

BS = 16
W = (2e-3, 2e-5, 1e-9, 1e-4, 1e-8)       # true iteration-time coefficients of the fake latency model
T = 0.05                                  # TPOT SLO (s): βT = 25 ms
M = 0.1                                   # SLO margin


class LinearLatency:
    """t = w0 + w1·P + w2·Σ n(c+n) + w3·D + w4·Σ ctx, computed here independently of the predictor."""

    def iteration_time(self, prefill, decode_contexts):
        p = sum(n for n, _ in prefill)
        pc = sum(n * (c + n) for n, c in prefill)
        return W[0] + W[1] * p + W[2] * pc + W[3] * len(decode_contexts) + W[4] * sum(decode_contexts)


def t_hat(prefill, decode_contexts):
    return LinearLatency().iteration_time(prefill, decode_contexts)


class Chunk(NamedTuple):
    """A shadow prefill entry of a batch, as the tests read it (read when the phase admitted it)."""
    job: object          # the shadow Request
    start: int           # its cached context
    num_new: int
    block_ids: list
    host_tokens: int


class Harness:
    """The controller inside a real engine (`LLMEngine` over a `SimulatedExecutor` of the test's latency): `plan`
    runs the scheduler's shadow phase (controller.plan, then spend_budget on the engine's shadow jobs) on a
    hand-built batch, `complete` and `on_iteration_end` the scheduler's postprocess path."""

    def __init__(self, engine):
        object.__setattr__(self, "engine", engine)
        object.__setattr__(self, "ctl", engine.controller)
        object.__setattr__(self, "kv", engine.kv)

    def __getattr__(self, name):          # credit, delta, cap, branch_counts, tpot_slo ...
        if name == "jobs":
            return self.engine.scheduler.waiting[Priority.SHADOW]
        return getattr(self.ctl, name)

    def __setattr__(self, name, value):
        if name == "credit":
            self.ctl.credit = value
        elif name == "jobs":
            self.engine.scheduler.waiting[Priority.SHADOW] = self.engine.scheduler.shadow.jobs = value
        else:
            object.__setattr__(self, name, value)

    def view(self, b):
        return b.view(lambda limit: self.engine.scheduler.free_shadow_tokens(limit, b.now))

    def budget(self, b, now):
        assert now == b.now
        return self.ctl.budget_seconds(self.view(b))

    def min_slack(self, b, now):
        return self.ctl.min_slack(self.view(b))

    def plan(self, b, now):
        assert now == b.now
        self.engine.scheduler._shadow_phase(b, now)
        entries = b.shadow_prefills
        assert all(r.priority is Priority.SHADOW and r.status is RequestStatus.WAITING for r, _ in entries)
        assert b.prefills[len(b.prefills) - len(entries):] == entries     # prefill entries, placed last
        return [Chunk(r, r.num_computed_tokens, n, list(r.block_ids), r.chunk_reload_tokens) for r, n in entries]

    def complete(self, chunks, now):
        b = ScheduledBatch(now)
        b.prefills = [(c.job, c.num_new) for c in chunks]
        b.num_shadow = len(chunks)
        before = self.engine.stats.shadow_tokens
        self.engine.scheduler.postprocess(b, None, now)
        return self.engine.stats.shadow_tokens - before

    def free_shadow_blocks(self, now):
        return self.kv.free_blocks(now=now, shadow=True)

    def on_iteration_end(self, b, duration):
        self.engine.scheduler.postprocess(b, None, b.now + duration, duration)


def controller(mode="harvest-slo", n_min=64, token_budget=2048, idle_cap_s=None, max_seqs=256, latency=None):
    # t̂ trusted as seeded (no warm-up probes, no growth cap): these tests check Algorithm 1 on an exact t̂
    pred = IterationPredictor(latency or LinearLatency(), warm_steps=0, growth=None)
    return ShadowController(mode, pred, tpot_slo=T, token_budget=token_budget,
                            max_seqs=max_seqs, margin=M, n_min=n_min, idle_cap_s=idle_cap_s)


def engine(latency=None, host_tier=None, **config):
    cfg = EngineConfig(block_size=BS, tpot_slo_s=T, margin=M, refit_predictor=False, **config)
    e = LLMEngine(SimulatedExecutor(latency or LinearLatency()), cfg, host_tier=host_tier)
    for name, value in (("warm_steps", 0), ("growth", None)):     # t̂ trusted as seeded: these tests check
        if hasattr(e.predictor, name):                             # Algorithm 1 on an exact t̂ (no warm-up)
            setattr(e.predictor, name, value)
    return e


def make(mode="harvest-slo", num_blocks=1024, n_min=64, token_budget=2048, idle_cap_s=None, shadow_fraction=0.25,
         max_seqs=256):
    h = Harness(engine(num_blocks=num_blocks, shadow_mode=mode, n_min=n_min, token_budget=token_budget,
                       idle_cap_s=idle_cap_s, shadow_fraction=shadow_fraction, max_seqs=max_seqs))
    return h, h.kv, h.jobs


def tokens(n, salt=0):
    return [(7 * i + 13 * salt + 1) % 500 for i in range(n)]


def precache(kv, toks, now=0.0):
    """Put toks' whole pages into the prefix cache (as a finished request would)."""
    blocks = kv.allocate(len(toks) // BS, now=now)
    kv.commit(blocks, toks, now=now)
    kv.free(blocks, now=now)


def decoding(rid, ctx, f, k, tpot, prio=Priority.NORMAL):
    r = Request(rid, [1] * ctx, 100, prio, arrival_time=0.0, arrival_seq=0, tpot_slo=tpot)
    r.append_token(2)
    r.num_computed_tokens = ctx
    r.first_token_time, r.num_decode_iters = f, k
    return r


def prefilling(rid, prompt_len, computed, arrival, ttft, prio=Priority.NORMAL):
    r = Request(rid, [1] * prompt_len, 100, prio, arrival_time=arrival, arrival_seq=0, ttft_slo=ttft)
    r.num_computed_tokens = computed
    return r


def batch_of(now, decodes=(), prefills=()):
    b = ScheduledBatch(now)
    b.decodes = list(decodes)
    b.prefills = list(prefills)
    b.num_tokens = len(b.decodes) + sum(n for _, n in b.prefills)
    b.has_routed = any(r.priority is Priority.ROUTED for r in b.decodes + [r for r, _ in b.prefills])
    return b


def batch_shape(batch):
    return [(n, r.num_computed_tokens) for r, n in batch.prefills], [r.num_computed_tokens + 1 for r in batch.decodes]


def hand_tokens(b, *, base, cached, pending, room, n_min):
    """Alg. 1 lines 10-12 by brute force over whole-page chunk sizes: largest k with base + added(k) <= b,
    at most `room` (KV / token room), 0 if below n_min."""
    best = 0
    for k in range(BS, min(pending, room) + 1, BS):
        if base + W[1] * k + W[2] * k * (cached + k) <= b:
            best = k
    return best if best >= max(n_min, 1) else 0


def planned(chunks):
    return sum(c.num_new for c in chunks)


# ------------------------------------------------------------------------------------------ line 1-2
@pytest.mark.parametrize("why", ["waiting", "blocked"])
def test_zero_when_waiting_or_blocked(why):
    ctl, pool, jobs = make()
    jobs.upsert("s", tokens(4096), now=0.0)
    b = batch_of(1.0)
    b.waiting_nonempty = why == "waiting"
    b.admission_blocked = why == "blocked"
    assert ctl.budget(b, 1.0) == (0.0, "blocked")
    assert ctl.plan(b, 1.0) == []
    assert pool.stats.lookups == 0 and pool.num_free_blocks == 1024


# ------------------------------------------------------------------------------------------ line 3-4
@pytest.mark.parametrize("cached", [0, 1024])
def test_idle_budget_is_beta_T(cached):
    ctl, pool, jobs = make()
    hist = tokens(4096)
    precache(pool, hist[:cached])
    jobs.upsert("s", hist, now=0.0)
    b = batch_of(1.0)
    assert ctl.budget(b, 1.0) == (pytest.approx(0.5 * T), "idle")
    chunks = ctl.plan(b, 1.0)
    want = hand_tokens(0.5 * T, base=W[0], cached=cached, pending=4096 - cached, room=min(2048, 256 * BS),
                       n_min=64)
    assert want > 0
    assert planned(chunks) == want
    assert len(chunks) == 1 and chunks[0].start == cached
    assert W[0] + W[1] * want + W[2] * want * (cached + want) <= 0.5 * T
    assert pool.num_shadow_blocks == len(chunks[0].block_ids[cached // BS:])


def test_idle_cap_override():
    ctl, pool, jobs = make(idle_cap_s=0.010)
    jobs.upsert("s", tokens(4096), now=0.0)
    assert ctl.budget(batch_of(1.0), 1.0) == (0.010, "idle")
    assert planned(ctl.plan(batch_of(1.0), 1.0)) == hand_tokens(0.010, base=W[0], cached=0, pending=4096,
                                                                 room=2048, n_min=64)


# ------------------------------------------------------------------------------------------ line 5-6
@pytest.mark.parametrize("credit", [0.005, 0.100, 0.0005])
def test_routed_call_spends_credit(credit):
    ctl, pool, jobs = make()
    jobs.upsert("s", tokens(4096), now=0.0)
    ctl.credit = credit
    routed = decoding("r", 300, f=0.99, k=0, tpot=T, prio=Priority.ROUTED)   # σ = 0.045 - 0.01 = 0.035 s
    normal = decoding("n", 500, f=0.9, k=3, tpot=T)                          # σ = 0.18 - 0.1 = 0.08 s
    b = batch_of(1.0, decodes=[routed, normal])
    assert ctl.min_slack(b, 1.0) - t_hat(*batch_shape(b)) > 0.5 * T             # the slack does not bind
    b_sec = min(credit, 0.5 * T)
    assert ctl.budget(b, 1.0) == (pytest.approx(b_sec), "credit")
    chunks = ctl.plan(b, 1.0)
    # the credit pays only for the time the shadow adds: t̂(B+n) - t̂(B) <= b
    want = hand_tokens(b_sec, base=0.0, cached=0, pending=4096, room=2048 - 2, n_min=64)
    assert planned(chunks) == want
    added = W[1] * want + W[2] * want * want
    assert ctl.credit == pytest.approx(credit - added)
    assert ctl.credit >= 0


def test_credit_is_capped_by_the_slack_of_the_batch():
    """§3.2: the credit is spent "capped by the budget": t̂(B + n) may not exceed min σ_r of the batch."""
    ctl, pool, jobs = make()
    jobs.upsert("s", tokens(4096), now=0.0)
    ctl.credit = 0.010
    now = 10.0
    routed = decoding("r", 300, f=9.99, k=0, tpot=T, prio=Priority.ROUTED)  # σ = 0.045 - 0.01 = 0.035 s
    normal = decoding("n", 500, f=9.468, k=11, tpot=T)                      # σ = 0.54 - 0.532 = 0.008 s
    b = batch_of(now, decodes=[routed, normal])
    base = W[0] + 2 * W[3] + W[4] * (301 + 501)                             # t̂(B), by hand
    b_sec = 0.9 * 0.05 * 12 - (now - 9.468) - base                         # min σ - t̂(B) = 5.79 ms < credit
    assert 0 < b_sec < 0.010
    assert ctl.budget(b, now) == (pytest.approx(b_sec), "credit")
    chunks = ctl.plan(b, now)
    want = hand_tokens(b_sec, base=0.0, cached=0, pending=4096, room=2048 - 2, n_min=64)
    assert want > 0 and planned(chunks) == want
    assert base + W[1] * want + W[2] * want * want <= 0.9 * 0.05 * 12 - (now - 9.468)
    assert ctl.credit == pytest.approx(0.010 - W[1] * want - W[2] * want * want)

    # a normal request already past its Eq. 1 line blocks the credit (σ = 0.495 - 0.5 < 0)
    jobs2 = ShadowQueue(BS)
    jobs2.upsert("s2", tokens(4096, salt=1), now=0.0)
    ctl.jobs = jobs2
    ctl.credit = 0.010
    late = decoding("n", 500, f=9.5, k=10, tpot=T)
    b = batch_of(now, decodes=[routed, late])
    assert ctl.budget(b, now)[1] == "credit" and ctl.budget(b, now)[0] < 0
    assert ctl.plan(b, now) == [] and ctl.credit == 0.010


def test_harvest_uses_credit_on_every_busy_iteration():
    ctl, pool, jobs = make(mode="harvest")
    jobs.upsert("s", tokens(4096), now=0.0)
    ctl.credit = 0.004
    b = batch_of(1.0, decodes=[decoding("n", 500, f=0.9, k=1, tpot=T)])     # normal traffic only
    assert ctl.budget(b, 1.0) == (pytest.approx(0.004), "credit")
    assert planned(ctl.plan(b, 1.0)) == hand_tokens(0.004, base=0.0, cached=0, pending=4096, room=2047, n_min=64)
    assert ctl.budget(batch_of(2.0), 2.0) == (pytest.approx(0.5 * T), "idle")


# ------------------------------------------------------------------------------------------ line 7-8
def test_slo_slack_of_decodes_eq1():
    ctl, pool, jobs = make(n_min=16)
    jobs.upsert("s", tokens(4096), now=0.0)
    now = 10.0
    decs = [decoding("a", 100, f=9.0, k=40, tpot=T),       # σ = 0.9·0.05·41 - 1.0 = 0.845 s
            decoding("b", 2000, f=9.5, k=10, tpot=T),      # σ = 0.9·0.05·11 - 0.5 = -0.005 s
            decoding("c", 700, f=9.99, k=0, tpot=T)]       # σ = 0.045 - 0.01 = 0.035 s
    sigmas = [(1 - M) * r.tpot_slo * (r.num_decode_iters + 1) - (now - r.first_token_time) for r in decs]
    b = batch_of(now, decodes=decs)
    assert ctl.min_slack(b, now) == pytest.approx(min(sigmas))
    assert ctl.budget(b, now)[1] == "slo"
    assert ctl.plan(b, now) == []                          # the late request blocks shadow work

    decs[1] = decoding("b", 2000, f=9.5, k=12, tpot=T)     # σ = 0.9·0.05·13 - 0.5 = 0.085 s
    decs[2] = decoding("c", 700, f=9.99, k=0, tpot=0.03)   # σ = 0.027 - 0.01 = 0.017 s
    b = batch_of(now, decodes=decs)
    b_sec = min(0.5 * T, 0.9 * 0.05 * 13 - 0.5, 0.9 * 0.03 - 0.01)
    assert ctl.budget(b, now) == (pytest.approx(b_sec), "slo")
    base = t_hat(*batch_shape(b))
    want = hand_tokens(b_sec, base=base, cached=0, pending=4096, room=2048 - 3, n_min=16)
    assert want > 0
    assert planned(ctl.plan(b, now)) == want


def test_slo_slack_of_prefilling_request():
    ctl, pool, jobs = make(n_min=16, token_budget=1024)
    jobs.upsert("s", tokens(4096), now=0.0)
    now = 5.0
    # prompt 3000 tokens, 1000 computed, a 400-token chunk now: 1600 tokens remain after it (2 chunks).
    pre = prefilling("p", 3000, 1000, arrival=4.9, ttft=0.18)
    dec = decoding("d", 100, f=4.0, k=30, tpot=T)          # σ = 0.9·0.05·31 - 1 = 0.395 s
    b = batch_of(now, decodes=[dec], prefills=[(pre, 400)])
    p_hat, done = 0.0, 1400
    while done < 3000:                                     # later chunks, one iteration each
        n = min(1024, 3000 - done)
        p_hat += W[0] + W[1] * n + W[2] * n * (done + n)
        done += n
    slack = (1 - M) * 0.18 - (now - 4.9) - p_hat
    assert 0 < slack < 0.5 * T                            # the prefilling request's slack binds
    assert ctl.min_slack(b, now) == pytest.approx(min(slack, 0.9 * 0.05 * 31 - 1.0))
    b_sec = min(0.5 * T, slack, 0.395)
    assert ctl.budget(b, now) == (pytest.approx(b_sec), "slo")
    base = t_hat(*batch_shape(b))
    want = hand_tokens(b_sec, base=base, cached=0, pending=4096, room=1024 - 401, n_min=16)
    assert 0 < want < 1024 - 401 - BS                     # ... and time, not tokens, limits the chunk
    assert planned(ctl.plan(b, now)) == want


# ----------------------------------------------------------------------------------- line 11 and 12
def test_kv_cap_limits_tokens():
    ctl, pool, jobs = make(num_blocks=64)                  # shadow cap: 16 pages = 256 tokens
    jobs.upsert("s", tokens(4096), now=0.0)
    assert ctl.free_shadow_blocks(1.0) == 16
    chunks = ctl.plan(batch_of(1.0), 1.0)
    assert planned(chunks) == 256
    assert hand_tokens(0.5 * T, base=W[0], cached=0, pending=4096, room=2048, n_min=64) > 256
    # the shadow class is full of in-flight pages now: nothing more fits
    ctl.branch_counts["idle"] = 0
    assert ctl.plan(batch_of(1.0), 1.0) == []


def test_n_min_defers_small_chunks():
    # βT-budget allows ~ (cap - w0) / w1 tokens: pick caps just below and above n_min = 256
    below = W[0] + W[1] * 255 + W[2] * 255 * 255
    above = W[0] + W[1] * 256 + W[2] * 256 * 256
    ctl, pool, jobs = make(n_min=256, idle_cap_s=below)
    jobs.upsert("s", tokens(4096), now=0.0)
    ctl.progressed(0.5)                                    # shadow work ran 0.5 s ago: no liveness probe due
    assert ctl.plan(batch_of(1.0), 1.0) == []
    assert pool.num_free_blocks == 1024                    # nothing taken
    ctl, pool, jobs = make(n_min=256, idle_cap_s=above * (1 + 1e-9))
    jobs.upsert("s", tokens(4096), now=0.0)
    assert planned(ctl.plan(batch_of(1.0), 1.0)) == 256
    # a job with fewer pending tokens than n_min is deferred
    ctl, pool, jobs = make(n_min=256)
    jobs.upsert("small", tokens(250), now=0.0)
    assert ctl.plan(batch_of(1.0), 1.0) == []


def test_idle_liveness_probe_when_the_budget_admits_nothing():
    """An idle instance whose b admits no chunk runs one probe of n_min tokens once LIVENESS_S passed since
    the last shadow progress (probe_due): only a measured step can show t̂ or its shrink wrong."""
    below = W[0] + W[1] * 255 + W[2] * 255 * 255          # βT just below a 256-token chunk (as above)
    ctl, pool, jobs = make(n_min=256, idle_cap_s=below)
    jobs.upsert("s", tokens(4096), now=0.0)
    b = batch_of(1.0)
    chunks = ctl.plan(b, 1.0)                              # no progress yet: due
    assert [c.num_new for c in chunks] == [256] and ctl.probes == 1
    assert b.budget_s == 0.0                               # not counted as an iteration bounded by b
    scale = ctl.predictor.budget_scale
    ctl.on_iteration_end(b, 100 * below)                   # far past b: a probe is not judged against it
    assert ctl.predictor.overruns == 0 and ctl.predictor.budget_scale == scale
    assert ctl.plan(batch_of(1.0 + 0.9 * LIVENESS_S), 1.0 + 0.9 * LIVENESS_S) == []     # not due yet
    later = batch_of(1.0 + LIVENESS_S)
    assert planned(ctl.plan(later, later.now)) == 256 and ctl.probes == 2
    assert ctl.engine.stats.shadow_probes == 2
    # never on a busy iteration: a decode with no slack blocks shadow work whatever the time since progress
    ctl, pool, jobs = make(n_min=256, idle_cap_s=below)
    jobs.upsert("s", tokens(4096), now=0.0)
    late = decoding("d", 100, f=0.0, k=5, tpot=T)          # Eq. 1 deadline long past at t = 10
    assert ctl.plan(batch_of(10.0, decodes=[late]), 10.0) == [] and ctl.probes == 0


def test_a_shrunk_budget_is_judged_before_its_shrink():
    """Feedback judges a shadow step against b before the shrink (ShadowBudget.bound_s): a step measured
    near t̂ under a shrunk b must not shrink it again, or b collapses to its floor for good."""
    ctl, pool, jobs = make(n_min=16)
    pred = ctl.predictor
    pred.budget_scale = 0.5
    jobs.upsert("s", tokens(4096), now=0.0)
    b = batch_of(1.0)
    assert planned(ctl.plan(b, 1.0)) > 0 and ctl.probes == 0
    shrunk = b.budget_s
    assert shrunk == pytest.approx(0.5 * ctl.cap)
    ctl.on_iteration_end(b, 2.0 * shrunk)                  # past 1.5 x the shrunk b, within the unshrunk one
    assert pred.overruns == 0 and pred.budget_scale == 0.5
    b2 = batch_of(2.0)
    assert planned(ctl.plan(b2, 2.0)) > 0 and b2.budget_s == shrunk
    ctl.on_iteration_end(b2, 4.0 * shrunk)                 # past 1.5 x the unshrunk b: shrinks
    assert pred.overruns == 1 and pred.budget_scale < 0.5


# ----------------------------------------------------------------------------------------- line 15
def test_jobs_taken_by_switch_probability():
    ctl, pool, jobs = make(n_min=16)
    jobs.upsert("low", tokens(4096, 1), now=0.0, switch_prob=0.2)
    jobs.upsert("high", tokens(160, 2), now=0.0, switch_prob=0.9)
    chunks = ctl.plan(batch_of(1.0), 1.0)
    assert [c.job.session_id for c in chunks] == ["high", "low"]
    assert chunks[0].num_new == 160
    # the second job gets what is left of the budget after the first chunk
    base = W[0] + W[1] * 160 + W[2] * 160 * 160
    assert chunks[1].num_new == hand_tokens(0.5 * T, base=base, cached=0, pending=4096, room=2048 - 160, n_min=16)


def test_complete_registers_shadow_pages_and_advances_job():
    ctl, pool, jobs = make(n_min=16)
    hist = tokens(300)
    jobs.upsert("s", hist, now=0.0)
    chunks = ctl.plan(batch_of(1.0), 1.0)
    assert planned(chunks) == 288
    assert ctl.complete(chunks, 1.1) == 288
    assert jobs.get("s").num_cached == 288 and jobs.get("s").pending_tokens(BS) == 0
    assert pool.stats.shadow_cached_blocks == 18
    assert pool.peek_prefix(hist) == (288, 0)


# ------------------------------------------------------------------------------------------- credit
def test_credit_accrual():
    ctl, _, _ = make(mode="harvest-slo")
    assert ctl.delta == 0.025
    decode_only = batch_of(1.0, decodes=[decoding("d", 10, f=0.0, k=0, tpot=T)])
    mixed = batch_of(1.0, decodes=[decoding("d", 10, f=0.0, k=0, tpot=T)],
                     prefills=[(prefilling("p", 100, 0, 0.0, 1.0), 100)])
    ctl.on_iteration_end(decode_only, 0.02)
    ctl.on_iteration_end(mixed, 0.05)
    ctl.on_iteration_end(batch_of(1.0), 0.01)
    assert ctl.credit == pytest.approx(0.025 * 0.02)
    h, _, _ = make(mode="harvest")
    assert h.delta == 0.1
    h.on_iteration_end(decode_only, 0.02)
    h.on_iteration_end(mixed, 0.05)
    h.on_iteration_end(batch_of(1.0), 0.01)                # idle: not busy
    assert h.credit == pytest.approx(0.1 * 0.07)


def test_mode_none_and_eager_never_budget():
    for mode in ("none", "eager"):
        ctl, _, jobs = make(mode=mode)
        jobs.upsert("s", tokens(1024), now=0.0)
        assert ctl.plan(batch_of(1.0), 1.0) == []


def test_default_slos_follow_paper_rule():
    pred = IterationPredictor(LinearLatency())
    decode_1 = W[0] + W[3] + W[4] * 1024
    assert default_tpot_slo(pred) == pytest.approx(max(0.025, 5 * decode_1))
    isolated = sum(W[0] + W[1] * n + W[2] * n * (c + n) for n, c in [(2048, 0), (2048, 2048), (904, 4096)])
    assert default_ttft_slo(pred, 5000, 2048) == pytest.approx(max(1.0, 5 * isolated))
    assert default_ttft_slo(pred, 10, 2048) == 1.0
    ctl = ShadowController("harvest-slo", pred, tpot_slo=0.04)
    assert math.isclose(ctl.cap, 0.5 * 0.04)


def test_engine_takes_default_slos_from_the_rule():
    e = LLMEngine(SimulatedExecutor(LinearLatency()), EngineConfig(num_blocks=512, block_size=BS))
    assert e.tpot_slo == pytest.approx(default_tpot_slo(e.predictor))
    r = e.add_request("r", [1] * 5000, 4)
    assert r.ttft_slo == pytest.approx(default_ttft_slo(e.predictor, 5000, 2048))


# ------------------------------------------------------------ host reloads count in t̂ (their exposed part)
LAYERS = 4


def pipeline(compute_s, reload_s, layers=LAYERS):
    """The layer-wise reload by hand, layer by layer: copy l ends at (l+1)·R/L, layer l computes C/L once
    layer l-1 is done and copy l arrived."""
    end = 0.0
    for layer in range(layers):
        end = max(end, (layer + 1) * reload_s / layers) + compute_s / layers
    return end


class ReloadingLatency(LinearLatency):
    """LinearLatency plus a host-tier reload per token, overlapped layer-wise over LAYERS layers
    (model.latency.LatencyModel.overlapped_time has the same hook)."""

    def __init__(self, seconds_per_token):
        self.seconds_per_token = seconds_per_token

    def reload_time(self, num_tokens):
        return num_tokens * self.seconds_per_token

    def overlapped_time(self, compute_s, reload_tokens, head_start_s=0.0):
        assert head_start_s == 0.0
        return pipeline(compute_s, self.reload_time(reload_tokens))


def make_with_host(seconds_per_token, num_blocks=1024):
    from shadowprefill.kv.host_tier import HostTier

    h = Harness(engine(ReloadingLatency(seconds_per_token), HostTier(num_pages=4096, page_bytes=1024),
                       num_blocks=num_blocks, page_bytes=1024, n_min=64))
    return h, h.kv, h.jobs


def spill_to_host(pool, toks):
    """Cache toks' pages, then push them to the host tier by allocating the whole pool as normal pages."""
    precache(pool, toks)
    everything = pool.allocate(pool.num_blocks, now=0.5)
    assert everything is not None
    pool.free(everything, now=0.5)
    assert pool.peek_prefix(toks) == (0, len(toks))


def chunk_s(k, cached):
    return W[1] * k + W[2] * k * (cached + k)


@pytest.mark.parametrize("seconds_per_token", [10e-6, 25e-6, 45e-6, 60e-6])
def test_host_reload_counts_only_what_the_compute_does_not_hide(seconds_per_token):
    ctl, pool, jobs = make_with_host(seconds_per_token)
    hist = tokens(4096)
    spill_to_host(pool, hist[:512])
    jobs.upsert("s", hist, now=1.0)
    b = batch_of(1.0)
    chunks = ctl.plan(b, 1.0)
    reload = 512 * seconds_per_token
    fits = [k for k in range(BS, 2048 + 1, BS) if pipeline(W[0] + chunk_s(k, 512), reload) <= 0.5 * T]
    want = max(fits, default=0) if max(fits, default=0) >= 64 else 0
    serial = hand_tokens(0.5 * T, base=W[0] + reload, cached=512, pending=4096 - 512, room=2048, n_min=64)
    assert planned(chunks) == want and want >= serial
    if seconds_per_token == 45e-6:         # copy + compute would not fit at all; overlapped, 272 tokens do
        assert (serial, want) == (0, 272)
    if want == 0:      # even overlapped the reload overruns βT: nothing reloaded, the prefix stays on the host
        assert chunks == [] and b.reload_tokens == 0
        assert pool.peek_prefix(hist[:512]) == (0, 512)
    else:
        assert chunks[0].start == 512 and b.reload_tokens == 512


def test_credit_pays_the_overlapped_reload():
    """Credit branch: the shadow pays t̂(B + chunk with its reload) - t̂(B), the reload overlapping the whole
    iteration's compute (the routed batch's too)."""
    ctl, pool, jobs = make_with_host(20e-6)
    hist = tokens(2048)
    spill_to_host(pool, hist[:256])
    jobs.upsert("s", hist, now=1.0)
    ctl.credit = 0.01
    b = batch_of(1.0, decodes=[decoding("r", 300, f=0.99, k=0, tpot=T, prio=Priority.ROUTED)])  # σ = 35 ms
    batch_s = W[0] + W[3] + W[4] * 301
    chunks = ctl.plan(b, 1.0)
    reload = 256 * 20e-6
    fits = [k for k in range(BS, 2048, BS) if pipeline(batch_s + chunk_s(k, 256), reload) - batch_s <= 0.01]
    assert planned(chunks) == max(fits) and chunks[0].host_tokens == 256
    paid = pipeline(batch_s + chunk_s(max(fits), 256), reload) - batch_s
    assert ctl.credit == pytest.approx(0.01 - paid)


def test_set_tpot_slo_moves_beta_T_unless_the_cap_is_fixed():
    ctl = controller()
    ctl.set_tpot_slo(0.08)
    assert ctl.tpot_slo == 0.08 and ctl.cap == pytest.approx(0.5 * 0.08)
    fixed = controller(idle_cap_s=0.01)
    fixed.set_tpot_slo(0.08)
    assert fixed.cap == 0.01
    with pytest.raises(ValueError, match="tpot_slo"):
        ctl.set_tpot_slo(0.0)


def test_a_last_chunk_below_n_min_runs_when_it_fits():
    ctl, pool, jobs = make(n_min=256)
    h = ctl
    budget = h.ctl.plan(h.view(batch_of(1.0)))
    assert budget.max_tokens(0, block_size=BS) >= 256
    assert budget.max_tokens(0, block_size=BS, remaining=100) == 100       # the tail of a shadow request
    assert budget.max_tokens(0, block_size=BS, remaining=300) >= 256        # not a tail: the usual rule
    tight = controller(n_min=256, idle_cap_s=(W[0] + W[1] * 50 + W[2] * 50 * 50) * (1 + 1e-9))
    b = tight.plan(h.view(batch_of(1.0)))
    assert b.max_tokens(0, remaining=100) == 0                              # 100 tokens do not fit in b
    assert b.max_tokens(0, remaining=50) == 50


@pytest.mark.parametrize("mode", ["harvest-slo", "harvest"])
def test_count_idle_plan_counts_the_branch_only(mode):
    """count_idle_plan (the engine has no shadow job, so builds no view): the same branch as the full plan is
    counted, b is 0, and credit is untouched; over random iterations the branch counts match the full plan's."""
    import random
    rng = random.Random(5)
    full, quick = controller(mode), controller(mode)
    for i in range(300):
        now = 10.0 + i * 0.01
        decs = [decoding(f"d{j}", rng.randrange(1, 900), f=now - rng.uniform(0, 2), k=rng.randrange(0, 60),
                         tpot=T, prio=rng.choice((Priority.NORMAL, Priority.ROUTED)))
                for j in range(rng.randrange(0, 5))]
        pres = [(prefilling(f"p{j}", 600, rng.randrange(0, 300), now - 0.1, 1.0), 100) for j in range(rng.randrange(0, 2))]
        b = batch_of(now, decodes=decs, prefills=pres)
        b.waiting_nonempty = rng.random() < 0.2
        b.has_routed = any(r.priority is Priority.ROUTED for r in decs)
        credit = rng.uniform(0, 0.02)
        full.credit = quick.credit = credit
        want = full.plan(b.view(0))
        quick.count_idle_plan(b.waiting_nonempty, b.admission_blocked, b.has_requests, b.has_routed)
        assert quick.last_branch == want.branch == full.budget_seconds(b.view(0))[1]
        assert quick.last_budget == 0.0 and quick.credit == credit
        assert quick.branch_counts == full.branch_counts
    assert sum(v > 0 for v in full.branch_counts.values()) >= 3      # several branches were exercised
