"""The seed of the scheduler's iteration predictor t̂: this project's roofline (`model.latency.LatencyModel`)
for the served model's shape, or, if the shape cannot be read, a flat per-step / per-token model.

The seed only shapes the first predictions: the scheduler refits t̂ on vLLM's measured step times, and the
predictor's guardrails (probes of n_min until warm, 2x growth over the largest measured step, feedback from
overrun steps) hold whatever the fit says. The roofline assumes an H100 and the machine may be anything, so
the seed weighs `SEED_WEIGHT` of one measured step: at full weight (κ = 1) a tiny model's roofline on a CPU
kept the fitted per-token prefill cost near zero after 2,044-token steps measured at 101 ms (issue 21).
"""
from __future__ import annotations

import logging
from types import SimpleNamespace

from shadowprefill.shadow.predictor import IterationPredictor

logger = logging.getLogger("vllm.shadowprefill")  # under vLLM's configured logger

SEED_WEIGHT = 0.01          # the seed's information, in measured steps (IterationPredictor prior_weight)


class FlatLatency:
    """t = step_s + token_s x tokens (prefill and decode tokens alike)."""

    def __init__(self, step_s: float = 5e-3, token_s: float = 2e-5) -> None:
        self.step_s, self.token_s = step_s, token_s

    def iteration_time(self, prefill, decode_contexts) -> float:
        return self.step_s + self.token_s * (sum(n for n, _ in prefill) + len(decode_contexts))


def model_shape(hf_config) -> SimpleNamespace:
    """The attributes `LatencyModel` reads, from a Hugging Face text config."""
    heads = int(hf_config.num_attention_heads)
    hidden = int(hf_config.hidden_size)
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    return SimpleNamespace(num_layers=int(hf_config.num_hidden_layers), hidden_size=hidden, num_heads=heads,
                           num_kv_heads=int(kv_heads), head_dim=int(head_dim),
                           intermediate_size=int(hf_config.intermediate_size), vocab_size=int(hf_config.vocab_size))


def seed_latency_model(vllm_config):
    """A latency model for `IterationPredictor` from a vLLM config (roofline on an H100, TP as configured)."""
    try:
        from shadowprefill.model.latency import LatencyModel
        shape = model_shape(vllm_config.model_config.hf_text_config)
        return LatencyModel(shape, "h100", tp=int(vllm_config.parallel_config.tensor_parallel_size))
    except Exception as e:  # noqa: BLE001 - any unreadable config falls back to the flat seed
        logger.warning("ShadowScheduler: roofline seed unavailable (%s: %s); using a flat seed", type(e).__name__, e)
        return FlatLatency()


def make_predictor(vllm_config, n_min: int) -> IterationPredictor:
    """The scheduler's t̂: seeded from `seed_latency_model`, probes of `n_min` until warm."""
    return IterationPredictor(seed_latency_model(vllm_config), max_context=vllm_config.model_config.max_model_len,
                              prior_weight=SEED_WEIGHT, probe_tokens=n_min)
