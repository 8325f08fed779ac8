"""The engine on a virtual clock with the SimulatedExecutor: the discrete-event API, safety of shadow
work (a routed call waits at most one capped iteration; shadow iterations stay within their budget),
credit accounting, has_work, host-tier reload time."""
import pytest

from shadowprefill.engine.clock import VirtualClock, WallClock
from shadowprefill.engine.config import EngineConfig
from shadowprefill.engine.executor import SimulatedExecutor
from shadowprefill.engine.llm_engine import LLMEngine

W = (2e-3, 2e-5, 1e-9, 1e-4, 1e-8)


LAYERS = 4


def pipeline(compute_s, reload_s, head_start_s=0.0, layers=LAYERS):
    """A layer-wise reload by hand: copy l ends at (l+1)·R/L - head start, layer l computes C/L once layer
    l-1 is done and its copy arrived."""
    end = 0.0
    for layer in range(layers):
        end = max(end, (layer + 1) * reload_s / layers - head_start_s) + compute_s / layers
    return end


class LinearLatency:
    """Exactly linear in the predictor's features, so predicted and simulated times agree; with
    `reload_s_per_token`, host-tier reloads overlap the compute layer by layer over LAYERS layers."""

    def __init__(self, reload_s_per_token=None):
        if reload_s_per_token is not None:
            self.reload_time = lambda tokens: reload_s_per_token * tokens
            self.overlapped_time = lambda compute, tokens, head_start_s=0.0: pipeline(
                compute, reload_s_per_token * tokens, head_start_s)

    def iteration_time(self, prefill, decode_contexts):
        return (W[0] + W[1] * sum(n for n, _ in prefill) + W[2] * sum(n * (c + n) for n, c in prefill)
                + W[3] * len(decode_contexts) + W[4] * sum(decode_contexts))


def toks(n, salt):
    return [(salt * 37 + 11 * i) % 1000 for i in range(n)]


def engine(mode="none", **cfg):
    cfg.setdefault("num_blocks", 4096)
    return LLMEngine(SimulatedExecutor(LinearLatency()), EngineConfig(shadow_mode=mode, tpot_slo_s=0.05, **cfg))


def test_clock_defaults_and_virtual_clock():
    e = engine()
    assert isinstance(e.clock, VirtualClock) and e.clock.now() == 0.0
    c = VirtualClock(5.0)
    c.advance(0.5)
    c.advance_to(7.0)
    assert c.now() == 7.0
    with pytest.raises(ValueError):
        c.advance(-1.0)
    with pytest.raises(ValueError):
        c.advance_to(6.0)
    w = WallClock()
    t0 = w.now()
    w.advance(100.0)                                            # wall time is not moved by hand
    assert 0 <= w.now() - t0 < 50


def test_discrete_event_api_and_timing_fields():
    e = engine()
    e.clock.advance_to(1.0)
    r = e.add_request("a", toks(100, 1), 3, ttft_slo=2.0, tpot_slo=0.1)
    it = e.schedule_step()
    assert it.start == 1.0 and it.duration == pytest.approx(LinearLatency().iteration_time([(100, 0)], []))
    with pytest.raises(RuntimeError):
        e.schedule_step()
    e.clock.advance_to(1.0 + it.duration)
    outs = e.complete_step(it)
    assert outs[0].first_token_time == pytest.approx(1.0 + it.duration)
    assert outs[0].ttft == pytest.approx(it.duration)
    while e.has_work():
        e.step()
    assert r.finish_time == pytest.approx(e.clock.now())
    assert e.stats.busy_time_s == pytest.approx(e.clock.now() - 1.0)


def first_token_time(e, arrival, prompt):
    """Run e's iterations until `arrival`, add the routed call then (mid-iteration if one is running),
    and return (time of its first token, iterations it took)."""
    while True:
        it = e.schedule_step()
        if it is None or it.start + it.duration > arrival:
            break
        e.clock.advance(it.duration)
        e.complete_step(it)
    e.clock.advance_to(arrival)
    e.add_request("call", prompt, 2, priority="routed", session_id="other")
    if it is not None:                                          # arrived mid-iteration: it finishes first
        e.clock.advance_to(it.start + it.duration)
        e.complete_step(it)
    iterations = 0
    while True:
        iterations += 1
        outs = {o.request_id: o for o in e.step()}
        if "call" in outs:
            return outs["call"].first_token_time, iterations


@pytest.mark.parametrize("arrival", [0.0031, 0.05, 0.2])
def test_routed_call_waits_at_most_one_capped_iteration(arrival):
    prompt = toks(700, 5)
    base = engine("none")
    t_base, it_base = first_token_time(base, arrival, prompt)
    e = engine("harvest-slo", n_min=64)
    for i in range(6):
        e.add_shadow(f"s{i}", toks(3000, 10 + i), switch_prob=0.1 * i)
    t_shadow, it_shadow = first_token_time(e, arrival, prompt)
    assert e.stats.shadow_tokens > 0
    assert it_shadow == it_base                                  # no extra iteration once it is queued
    assert t_base <= t_shadow <= t_base + e.controller.cap + 1e-12


def test_shadow_iterations_stay_within_budget_under_load():
    e = engine("harvest-slo", n_min=32, token_budget=512)
    reqs = [e.add_request(f"n{i}", toks(200 + 50 * i, i), 60, tpot_slo=0.02 + 0.002 * i) for i in range(12)]
    e.add_request("routed", toks(300, 99), 10, priority="routed")
    for i in range(4):
        e.add_shadow(f"s{i}", toks(5000, 50 + i))
    lat = LinearLatency()
    branches = set()
    filled = 0
    while e.has_work():
        it = e.schedule_step()
        if it is None:
            break
        b = it.batch
        if b.num_shadow:
            branch, budget = e.controller.last_branch, e.controller.last_budget
            branches.add(branch)
            filled += branch != "credit"
            assert it.budget_s == (0.0 if branch == "credit" else budget)
            if branch == "credit":                              # shadow's added time within the credit
                added = it.duration - lat.iteration_time(b.view(0).prefill_pairs(), b.view(0).decode_contexts())
                assert added <= budget + 1e-12
            else:                                               # the whole iteration within min slack / βT
                assert it.duration <= budget + 1e-12
                assert it.duration <= e.controller.cap + 1e-12
        e.clock.advance(it.duration)
        e.complete_step(it)
    assert all(r.is_finished for r in reqs)
    assert e.stats.shadow_tokens > 0
    assert "slo" in branches
    st = e.stats
    assert st.credit_spent_s <= st.credit_earned_s + 1e-12
    assert st.shadow_budget_iterations == filled > 0 and st.shadow_over_budget == 0
    assert 0.0 < st.shadow_budget_ratio_max <= 1.0 + 1e-9


class ScaledLatency(LinearLatency):
    """The machine runs `factor` times slower than the t̂ seed says."""

    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def iteration_time(self, prefill, decode_contexts):
        return self.factor * super().iteration_time(prefill, decode_contexts)


def test_an_under_predicting_t_hat_shows_as_iterations_over_budget():
    # negative control for the stats above: t̂ seeded 2x too fast and never refitted overspends b
    e = LLMEngine(SimulatedExecutor(ScaledLatency(2.0)),
                  EngineConfig(shadow_mode="harvest-slo", tpot_slo_s=0.05, num_blocks=4096, n_min=32,
                               token_budget=512, refit_predictor=False), latency_model=LinearLatency())
    e.predictor.warm_steps, e.predictor.growth = 0, None       # trusted as seeded (never measured: no warm-up)
    for i in range(6):
        e.add_request(f"n{i}", toks(200 + 50 * i, i), 40, tpot_slo=0.2)
    for i in range(2):
        e.add_shadow(f"s{i}", toks(3000, 50 + i))
    while e.has_work():
        if not e.step() and not e.scheduler.has_unfinished():
            break
    st = e.stats
    assert st.shadow_budget_iterations > 0
    assert st.shadow_over_budget > 0.5 * st.shadow_budget_iterations
    assert st.shadow_budget_ratio_max > 1.05


def test_credit_lets_shadow_ride_routed_decodes():
    e = engine("harvest-slo", n_min=32)
    e.add_request("routed", toks(100, 1), 400, priority="routed")
    e.add_shadow("s", toks(4000, 2))
    decode_only_time = 0.0
    while e.has_work():
        it = e.schedule_step()
        if it is None:
            break
        if it.batch.is_decode_only:
            decode_only_time += it.duration
        e.clock.advance(it.duration)
        e.complete_step(it)
    st = e.stats
    assert st.budget_branches["credit"] > 0
    assert st.credit_earned_s == pytest.approx(0.025 * decode_only_time)   # δ x decode-only time
    assert 0 < st.credit_spent_s <= st.credit_earned_s + 1e-12             # routed slowdown <= δ
    assert st.shadow_tokens > 0


def test_has_work_stalls_and_rearms():
    e = engine("harvest-slo", n_min=256)
    e.predictor.warm_steps, e.predictor.growth = 0, None       # t̂ trusted: no n_min probes first
    e.add_shadow("s", toks(200, 1))                             # 192 pending < n_min: deferred
    assert not e.has_work()
    assert e.step() == []
    e.add_shadow("s", toks(390, 1))                             # grows past n_min
    assert e.has_work()
    e.step()
    assert e.stats.shadow_tokens == 384
    assert not e.has_work()
    # mode none ignores shadow work
    n = engine("none")
    n.add_shadow("s", toks(400, 1))
    assert not n.has_work()


def test_an_idle_engine_whose_budget_collapsed_still_finishes_its_shadow_work():
    """The feedback shrink relaxes only with measured prefill steps; an idle engine whose shrunk b admits
    no chunk (seen: a cold first forward on a busy CPU) ran none again before the liveness probe
    (ShadowController.probe_due). With it the job finishes and the probes' measured steps relax the
    shrink (t̂ is exact here: no probe overruns)."""
    from shadowprefill.shadow.controller import LIVENESS_S
    from shadowprefill.shadow.predictor import MIN_SCALE

    e = engine("harvest-slo", n_min=32, idle_cap_s=0.01)
    e.predictor.budget_scale = MIN_SCALE                       # b = 0.16 ms: below t̂ of any chunk (w0 = 2 ms)
    e.add_shadow("s", toks(2048, 3))
    while e.shadow_pending_tokens("s") and e.clock.now() < 600.0:
        if e.has_work():
            e.step()
        else:
            e.clock.advance(0.05)                              # idle: time passes
    st = e.stats
    assert e.shadow_pending_tokens("s") == 0 and st.shadow_tokens == 2048
    assert st.shadow_probes > 0 and e.predictor.overruns == 0
    assert e.predictor.budget_scale > MIN_SCALE                 # measured steps relaxed the shrink
    assert st.shadow_probes <= e.clock.now() / LIVENESS_S + 1   # at most one probe per LIVENESS_S


@pytest.mark.parametrize("n_min", [8, 16, 24])
def test_n_min_is_rounded_up_to_whole_pages(n_min):
    """Shadow chunks are whole pages: an n_min below one page admitted no chunk at all (t̂'s warm-up probes
    were n_min tokens, zero whole pages), so the job never ran (seen with the vLLM plugin: n_min 32 on
    128-token blocks). The engine and the plugin both round it up (policy.whole_block_n_min)."""
    from shadowprefill.shadow.policy import whole_block_n_min

    assert [whole_block_n_min(n, 16) for n in (1, 8, 16, 17, 32, 256)] == [16, 16, 16, 32, 32, 256]
    with pytest.raises(ValueError, match="block_size"):
        whole_block_n_min(16, 0)
    e = engine("harvest-slo", n_min=n_min, block_size=16)
    assert e.n_min == whole_block_n_min(n_min, 16) and e.predictor.probe_tokens == e.n_min
    e.add_shadow("s", toks(640, 5))
    while e.has_work() and e.clock.now() < 60.0:
        e.step()
    assert e.shadow_pending_tokens("s") == 0 and e.stats.shadow_tokens == 640


def test_switch_call_cancels_its_shadow_job():
    e = engine("harvest-slo", n_min=16, idle_cap_s=0.002 + 20 * 16 * 2e-5)   # ~20 pages per iteration
    e.add_shadow("s", toks(3000, 1))
    e.step()
    done = e.stats.shadow_tokens
    assert 0 < done < 2992
    r = e.add_request("switch", toks(3000, 1) + toks(10, 2), 1, priority="routed", session_id="s")
    assert "s" not in e.jobs
    while e.has_work():
        e.step()
    assert r.num_cached_tokens == done                          # partial shadow: cold fallback for the tail
    assert e.stats.shadow_tokens == done


def host_engine(reload_s_per_token, token_budget=512):
    """An engine whose request "a" (70 tokens) went to the host tier: 64 tokens (4 pages) to reload."""
    lat = LinearLatency(reload_s_per_token=reload_s_per_token)
    e = LLMEngine(SimulatedExecutor(lat), EngineConfig(num_blocks=12, token_budget=token_budget,
                                                       host_tier_gib=1e-3, page_bytes=4096, tpot_slo_s=0.05))
    e.add_request("a", toks(70, 1), 1)
    while e.has_work():
        e.step()
    for i in range(3):
        e.add_request(f"x{i}", toks(150, 10 + i), 1)
        while e.has_work():
            e.step()
    assert e.cached_prefix_tokens(toks(70, 1)) == (0, 64)
    return e, lat


def test_reload_is_charged_overlapped_with_the_compute():
    e, lat = host_engine(1e-6)
    r = e.add_request("b", toks(70, 1) + toks(20, 3), 1)
    it = e.schedule_step()
    assert it.batch.reload_tokens == 64
    compute = lat.iteration_time(*it.batch.shape())
    assert it.duration == pytest.approx(pipeline(compute, 64e-6))
    assert it.duration == pytest.approx(compute + 64e-6 / LAYERS)   # shorter than the compute: R/L shows
    n = e.predictor.num_observations
    e.clock.advance(it.duration)
    e.complete_step(it)
    assert r.num_host_cached_tokens == 64 and r.num_cached_tokens == 64
    assert e.predictor.num_observations == n                 # t̂ models compute: a reload stall is not observed
    e.add_request("c", toks(30, 9), 1)
    e.step()
    assert e.predictor.num_observations == n + 1              # the next iteration (no reload) is


def test_side_stream_timeline_matches_a_hand_replay():
    """SimulatedExecutor's host-tier timeline over random iterations, most without copies (which skip the
    overlap arithmetic): each duration equals a replay written here. A reload issued ahead counts only for the
    next iteration's admissions; the side stream runs this iteration's reloads, then those ahead."""
    import random
    from types import SimpleNamespace
    rng = random.Random(3)
    rate = 1e-4                                              # a reload outlasts several iterations
    ex = SimulatedExecutor(LinearLatency(reload_s_per_token=rate))
    side_free, ahead, now = -float("inf"), None, 0.0
    waited_ahead = 0
    for _ in range(400):
        now += rng.choice((0.0, 1e-4, 2e-3, 0.05))
        prefill = [(rng.randrange(1, 300), rng.randrange(0, 2000))] if rng.random() < 0.5 else []
        contexts = [rng.randrange(1, 4000) for _ in range(rng.randrange(0 if prefill else 1, 6))]
        copies = rng.random() < 0.3
        reload = rng.choice((0, 16, 64, 512)) if copies else 0
        prefetched = rng.choice((0, 32, 128)) if copies else 0
        issued = rng.choice((0, 0, 64, 256)) if copies else 0
        batch = SimpleNamespace(now=now, reload_tokens=reload, prefetched_tokens=prefetched, ahead_tokens=issued,
                                samples=[], shape=lambda p=prefill, c=contexts: (p, c))
        compute = LinearLatency().iteration_time(prefill, contexts)
        side = max(now, side_free)                          # the replay
        want = compute
        if reload:
            want = pipeline(compute, rate * reload, now - side)
            side += rate * reload
        if prefetched and ahead is not None:
            want = max(want, pipeline(compute, rate * ahead[1], now - ahead[0]))
            waited_ahead += 1
        ahead = None
        if issued:
            ahead = (side, issued)
            side += rate * issued
        side_free = side
        got = ex.execute(batch).duration
        assert got == pytest.approx(want, rel=1e-12, abs=0.0)
    assert waited_ahead > 5                                  # reloads ahead were waited on, not only issued


def test_reload_ahead_runs_during_the_previous_iteration():
    """A waiting request the next iteration admits starts its reload one iteration early: the iteration
    that issues it is not slowed, the one that admits it waits only for what is left of the copy."""
    e, lat = host_engine(1e-4, token_budget=64)            # 6.4 ms to reload 64 tokens
    e.add_request("long", toks(80, 7), 1)                  # takes the whole first budget
    b = e.add_request("b", toks(70, 1) + toks(20, 3), 1)
    first = e.schedule_step()
    assert [(r.request_id, n) for r, n in first.batch.prefills] == [("long", 64)]
    assert first.batch.ahead_tokens == 64 and first.batch.reload_tokens == 0
    assert b.status.value == "waiting" and b.prefetch.host_tokens == 64 and e.kv_stats.reloads == 4
    assert first.duration == pytest.approx(lat.iteration_time(*first.batch.shape()))
    e.clock.advance(first.duration)
    e.complete_step(first)
    second = e.schedule_step()
    assert [(r.request_id, n) for r, n in second.batch.prefills] == [("long", 16), ("b", 26)]
    assert second.batch.reload_tokens == 0 and second.batch.prefetched_tokens == 64
    compute = lat.iteration_time(*second.batch.shape())
    assert second.duration == pytest.approx(pipeline(compute, 6.4e-3, head_start_s=first.duration))
    assert compute < second.duration < compute + 6.4e-3      # the copy's first part ran under `first`
    e.clock.advance(second.duration)
    e.complete_step(second)
    assert b.num_host_cached_tokens == 64 and b.num_cached_tokens == 64 and e.kv_stats.reloads == 4


def test_reload_ahead_gives_its_pages_back_when_memory_is_short():
    """A reload ahead holds pages for a waiting request; when the admission (or a running request) then
    runs out of memory, those pages go back (cached, evictable) before anyone waits or is preempted."""
    e, lat = host_engine(1e-4, token_budget=64)
    e.add_request("long", toks(100, 7), 1)                 # 7 pages once prefilled: b's 6 do not fit beside
    b = e.add_request("b", toks(70, 1) + toks(20, 3), 1)
    first = e.schedule_step()
    held = list(b.prefetch.block_ids)
    assert first.batch.ahead_tokens == 64 and all(e.kv.ref_count(p) == 1 for p in held)
    e.clock.advance(first.duration)
    e.complete_step(first)
    second = e.schedule_step()
    assert second.batch.admission_blocked and b.status.value == "waiting" and b.prefetch is False
    assert all(e.kv.ref_count(p) == 0 for p in held) and e.scheduler.prefetched == []
    assert e.scheduler.num_preemptions == 0
    e.clock.advance(second.duration)
    e.complete_step(second)
    while e.has_work():
        e.step()
    assert b.num_cached_tokens == 64 and e.kv.num_free_blocks + e.kv.num_cached_blocks == 12


def test_a_running_request_takes_a_reload_aheads_pages_before_preempting():
    e, lat = host_engine(1e-4, token_budget=64)
    long = e.add_request("long", toks(128, 9), 3)          # 8 pages; its first decode needs a 9th
    b = e.add_request("b", toks(70, 1) + toks(20, 3), 1)
    for _ in range(2):                                     # long's two chunks; b reloaded ahead in the 2nd
        e.step()
    assert b.status.value == "waiting" and b.prefetch and e.kv.num_free_blocks + e.kv.num_cached_blocks == 0
    it = e.schedule_step()                                 # long's decode grows: b's pages go back first
    assert long in it.batch.decodes and b.prefetch is False and e.scheduler.num_preemptions == 0
    e.clock.advance(it.duration)
    e.complete_step(it)
    while e.has_work():
        e.step()
    assert long.finish_reason == "length" and b.finish_reason == "length" and e.scheduler.num_preemptions == 0


def test_eager_shadow_competes_as_normal_traffic():
    e = engine("eager")
    e.add_shadow("s", toks(3000, 1))
    e.add_request("n", toks(100, 2), 3)
    it = e.schedule_step()
    # the shadow request arrived first and takes the whole token budget: the normal request waits
    assert [(r.request_id.startswith("__shadow__"), n) for r, n in it.batch.prefills] == [(True, 2048)]
    assert it.batch.waiting_nonempty and it.batch.num_shadow == 0
    e.clock.advance(it.duration)
    e.complete_step(it)
    while e.has_work():
        e.step()
    assert e.stats.eager_shadow_tokens == 3000
    assert e.stats.requests_finished == 1


def test_predictor_learns_the_features_of_the_batch_that_ran():
    """The refit sees the executed batch's features (contexts before the iteration advanced them)."""
    from shadowprefill.shadow.predictor import batch_features

    seen, observed = [], []

    class Recording(LinearLatency):
        def iteration_time(self, prefill, decode_contexts):
            seen.append(batch_features(list(prefill), list(decode_contexts)))
            return super().iteration_time(prefill, decode_contexts)

    e = LLMEngine(SimulatedExecutor(Recording()), EngineConfig(num_blocks=4096, tpot_slo_s=0.05, token_budget=256))
    e.predictor.observe_features = lambda features, duration: observed.append(tuple(features))
    seen.clear()                                  # the predictor's seed fit probed the latency model
    for i in range(4):
        e.add_request(f"r{i}", toks(300 + 50 * i, i), 5)
    while e.has_work():
        it = e.schedule_step()
        e.clock.advance_to(it.start + it.duration)
        e.complete_step(it)
    assert len(observed) == len(seen) > 5
    assert observed == seen
