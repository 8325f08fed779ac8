"""Request split by owner: the SLO accounting of its outcome is an `SLOAccounting` (`Request.slo`), the replay
data an `OutputReplay`; the Request reads the accounting through, and an engine run fills it (and the
controller's inputs f_r, k_r) with the times and cache hits computed here by hand from a fixed iteration
time."""
import pytest

from shadowprefill.engine.config import EngineConfig
from shadowprefill.engine.executor import SimulatedExecutor
from shadowprefill.engine.llm_engine import LLMEngine
from shadowprefill.engine.request import OutputReplay, Priority, Request, SLOAccounting

DT = 0.004                                  # every iteration takes 4 ms


class Fixed:
    def iteration_time(self, prefill, decode_contexts):
        return DT


SLO_FIELDS = ("finish_time", "finish_reason", "num_cached_tokens", "num_host_cached_tokens")


def test_slo_fields_are_not_scheduler_slots_and_read_through():
    assert not set(SLO_FIELDS) & set(Request.__slots__)
    r = Request("a", [1, 2, 3], 2, Priority.ROUTED, 1.5, 0, ttft_slo=2.0, tpot_slo=0.1, replay_token_ids=[7])
    assert isinstance(r.slo, SLOAccounting) and isinstance(r.replay, OutputReplay)
    assert (r.arrival_time, r.ttft_slo, r.tpot_slo, r.first_token_time, r.num_decode_iters) == (1.5, 2.0, 0.1, None, 0)
    assert (r.finish_time, r.finish_reason, r.num_cached_tokens, r.num_host_cached_tokens) == (None, None, 0, 0)
    r.finish_reason, r.num_cached_tokens = "abort", 16       # written through to the accounting
    assert (r.slo.finish_reason, r.slo.num_cached_tokens) == ("abort", 16)
    r.slo.finish_time = 3.0
    assert r.finish_time == 3.0


def test_an_engine_run_fills_the_accounting():
    e = LLMEngine(SimulatedExecutor(Fixed()), EngineConfig(block_size=16, num_blocks=64, token_budget=16,
                                                           shadow_mode="none"))
    prompt = list(range(1, 41))                       # 40 tokens: 3 prefill chunks of at most 16
    r = e.add_request("a", prompt, 4, ttft_slo=1.0, tpot_slo=0.5)
    while e.has_work():
        e.step()
    slo = r.slo
    assert r.arrival_time == 0.0 and (r.ttft_slo, r.tpot_slo) == (1.0, 0.5)
    assert r.first_token_time == pytest.approx(3 * DT)            # sampled at the end of the third chunk
    assert r.num_decode_iters == 3 and slo.finish_time == pytest.approx(6 * DT) and slo.finish_reason == "length"
    assert (slo.num_cached_tokens, slo.num_host_cached_tokens) == (0, 0)
    again = e.add_request("b", prompt, 1, priority="routed")
    while e.has_work():
        e.step()
    assert again.slo.num_cached_tokens == 32                      # its prompt's two full pages were cached
    assert again.arrival_time == pytest.approx(6 * DT) and again.slo.finish_reason == "length"
    assert e.stats.cached_prompt_tokens == 32 and e.stats.routed_cached_prompt_tokens == 32
