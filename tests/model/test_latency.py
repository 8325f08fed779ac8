"""Latency model: calibration against the measured Vidur H100 profiles, roofline bounds, and properties."""
import csv
import dataclasses
import math
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from shadowprefill.model.catalog import get_model
from shadowprefill.sim import calibrate
from shadowprefill.model.gpus import GPUS, get_gpu
from shadowprefill.model.latency import H100, LatencyModel, linear_ops_ms, pipelined_reload_s

VIDUR = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "vidur-h100"
needs_vidur = pytest.mark.skipif(not VIDUR.is_dir(), reason=f"Vidur H100 profiles not found at {VIDUR}")
LINEAR = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_act", "mlp_down_proj")


def _measured_rows(name):
    """(shape kwargs, measured ms of the five linear ops) per CSV row, read independently of calibrate.py."""
    with (VIDUR / name).open(newline="") as f:
        for r in csv.DictReader(f):
            shape = dict(hidden_size=int(r["n_embd"]), intermediate_size=int(r["n_expanded_embd"]),
                         num_heads=int(r["n_head"]), num_kv_heads=int(r["n_kv_head"]),
                         num_tokens=int(r["num_tokens"]), tp=int(r["num_tensor_parallel_workers"]),
                         gated_mlp=r["use_gated_mlp"] == "True")
            yield shape, sum(float(r[f"time_stats.{op}.median"]) for op in LINEAR)


@needs_vidur
@pytest.mark.parametrize("name", ["Llama-2-7b-hf.mlp.csv", "Llama-2-70b-hf.mlp.csv"])
def test_shipped_constants_match_profiles(name):
    errors = [linear_ops_ms(**shape) / measured - 1 for shape, measured in _measured_rows(name)]
    assert len(errors) == 1044
    assert np.median(np.abs(errors)) <= 0.08
    assert np.percentile(np.abs(errors), 90) <= 0.25


@needs_vidur
def test_calibration_generalises_to_the_other_model():
    """Fit on one Llama-2 size, evaluate on the other: median error <= 8% both ways (issue 6)."""
    small = calibrate.load_profile(VIDUR / "Llama-2-7b-hf.mlp.csv")
    large = calibrate.load_profile(VIDUR / "Llama-2-70b-hf.mlp.csv")
    for train, test in ((small, large), (large, small)):
        cal = calibrate.fit_linear_ops(train, iters=800)
        held_out = np.abs(calibrate.linear_ops_errors(test, cal))
        assert np.median(held_out) <= 0.08, np.median(held_out)


@needs_vidur
def test_allreduce_constants_match_profile():
    ar = calibrate.load_allreduce(VIDUR / "h100_dgx.all_reduce.csv")
    for workers, err in calibrate.allreduce_errors(ar, H100).items():
        big = ar["size"][ar["workers"] == workers] >= 4 << 20          # sizes of prefill-sized batches
        assert np.median(np.abs(err)) <= 0.15, workers
        assert np.median(np.abs(err[big])) <= 0.10, workers


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_linear_ops_within_roofline_bounds(tp):
    """Never faster than the hardware peaks allow, and within 2.5x of them at both ends of the roofline."""
    h100 = GPUS["h100"]
    h, inter, heads, kv = 8192, 28672, 64, 8
    params = (h * (heads + 2 * kv) * 128 + heads * 128 * h + 3 * h * inter) / tp
    for tokens in (1, 16, 4096, 16384):
        ms = linear_ops_ms(h, inter, heads, kv, tokens, tp=tp)
        lower = max(2 * params * tokens / h100.peak_flops, 2 * params / h100.hbm_bw) * 1e3
        assert lower <= ms, tokens
        if tokens in (1, 16384):                                         # memory- resp. compute-bound
            assert ms <= 2.5 * lower, tokens


def test_linear_ops_validation():
    with pytest.raises(ValueError, match="num_tokens"):
        linear_ops_ms(4096, 11008, 32, 32, 0)
    with pytest.raises(ValueError, match="num_kv_heads"):
        linear_ops_ms(4096, 11008, 32, 3, 16)
    with pytest.raises(ValueError, match="unknown gpu"):
        linear_ops_ms(4096, 11008, 32, 32, 16, gpu="v100")


def test_kv_bytes_and_pool_size():
    gemma = LatencyModel("Gemma-7B")
    assert gemma.kv_bytes_per_token == 2 * 28 * 16 * 256 * 2 == 458752        # paper §3.3: 458 KB per token
    # "a single 100K-token agent context fills most of its H100's KV pool"
    assert 100_000 < gemma.max_kv_tokens(0.9) < 130_000
    llama = LatencyModel("Llama-3.1-8B")
    assert llama.kv_bytes_per_token * 16 == 2 * 1024 * 1024                   # DESIGN §3: 2 MiB page
    granite = LatencyModel("Granite-34B-Code")                                  # MQA: KV head on both GPUs
    assert granite.tp == 2 and granite.kv_bytes_per_token_per_gpu == 2 * 88 * 1 * 128 * 2
    with pytest.raises(ValueError, match="hbm_fraction"):
        llama.max_kv_tokens(1.5)


def test_decode_kv_read_term_matches_hand_count():
    """Extra context costs layers x KV bytes / (efficiency x HBM bandwidth) per token and sequence."""
    m = LatencyModel("Llama-3.1-70B", tp=4)
    per_token_layer = 2 * (8 // 4) * 128 * 2
    expected = 80 * 64 * 1000 * per_token_layer / (H100.gemm_bw_eff * GPUS["h100"].hbm_bw)
    delta = m.decode_time(64, 3000) - m.decode_time(64, 2000)
    assert math.isclose(delta, expected, rel_tol=1e-9)


def test_prefill_attention_grows_with_cached_context():
    m = LatencyModel("Qwen2.5-7B")
    a = m.iteration_time([(512, 0)], [])
    b = m.iteration_time([(512, 30000)], [])
    flops = 4 * 28 * 28 * 128 * 512 * 30000                                   # layers x heads x dim x q x c
    assert b - a >= flops / GPUS["h100"].peak_flops                           # at least the ideal compute
    assert b - a <= 4 * flops / GPUS["h100"].peak_flops


@pytest.mark.parametrize("name", ["Llama-3.1-8B", "Mixtral-8x7B", "Gemma-2-9B", "GPT-OSS-20B",
                                  "Qwen3-Next-80B-A3B", "Granite-34B-Code"])
def test_monotone_in_every_batch_dimension(name):
    m = LatencyModel(name)
    rng = random.Random(1)
    ctx = [rng.randint(1, 20000) for _ in range(64)]
    base = m.iteration_time([(256, 1000)], ctx)
    assert m.iteration_time([(512, 1000)], ctx) > base                      # more new tokens
    assert m.iteration_time([(256, 9000)], ctx) > base                      # more cached context
    assert m.iteration_time([(256, 1000)], ctx + [5000]) > base             # one more decode
    assert m.iteration_time([(256, 1000)], [c + 4000 for c in ctx]) > base  # longer decodes
    assert m.iteration_time([(256, 1000), (64, 0)], ctx) > base             # one more chunk
    assert m.iteration_time([], []) == 0.0


def test_list_and_array_decodes_agree_in_every_window_regime():
    m = LatencyModel("Gemma-2-9B")                                             # 4096-token sliding window
    for ctx in ([5000, 9000, 7000], [100, 2000, 4096], [100, 6000, 4097, 3000]):
        assert math.isclose(m.iteration_time([], ctx), m.iteration_time([], np.array(ctx)), rel_tol=1e-12)
    full = LatencyModel(dataclasses.replace(get_model("Gemma-2-9B"), sliding_window_layers=0))
    assert m.decode_time(32, 30000) < full.decode_time(32, 30000)
    assert math.isclose(m.decode_time(32, 1000), full.decode_time(32, 1000), rel_tol=1e-12)


def test_moe_reads_active_experts_at_small_batch():
    """Batch 1 reads ~active weights; a large batch touches every expert (appendix B)."""
    moe = LatencyModel("Mixtral-8x7B", tp=4)
    dense = LatencyModel("Llama-3.1-70B", tp=4)
    ratio_moe = moe.iteration_time([], [1] * 32) / moe.iteration_time([], [1])
    ratio_dense = dense.iteration_time([], [1] * 32) / dense.iteration_time([], [1])
    assert ratio_moe > 1.8 and ratio_dense < 1.25
    assert moe.decode_time(1, 1000) < 0.5 * dense.decode_time(1, 1000)


def test_tensor_parallelism_and_gpus():
    tp4, tp8 = LatencyModel("Llama-3.1-70B", tp=4), LatencyModel("Llama-3.1-70B", tp=8)
    assert tp8.prefill_time(2048) < tp4.prefill_time(2048)
    assert tp8.decode_time(1, 1000) < tp4.decode_time(1, 1000)
    h100, h200, a100 = (LatencyModel("Llama-3.1-8B", gpu=g) for g in ("h100", "h200", "a100"))
    assert h200.decode_time(64, 4000) < h100.decode_time(64, 4000) < a100.decode_time(64, 4000)
    assert h100.prefill_time(4096) < a100.prefill_time(4096)
    assert LatencyModel("Llama-3.1-70B").tp == 4 and LatencyModel("Mixtral-8x22B").tp == 8
    assert get_gpu("H200").hbm_bytes == 141e9


def test_helpers():
    m = LatencyModel("Llama-3.1-8B")
    ctx = [3000] * 100
    budget = 0.030
    n = m.max_prefill_tokens(budget, [], ctx, cached=5000)
    assert 0 < n < 65536
    assert m.iteration_time([(n, 5000)], ctx) <= budget < m.iteration_time([(n + 1, 5000)], ctx)
    assert m.max_prefill_tokens(1e-6, [], ctx) == 0
    whole, chunked = m.prefill_time(8192), m.prefill_time(8192, chunk=2048)
    assert chunked > whole                                                   # re-reads KV, pays overheads
    assert math.isclose(chunked, sum(m.iteration_time([(2048, c)], []) for c in (0, 2048, 4096, 6144)))
    assert m.decode_time(8, 100) == m.iteration_time([], [100] * 8)
    assert m.energy_j(10.0, 5.0) == pytest.approx(10 * 560 + 5 * 75)
    assert m.host_transfer_time(1000) == pytest.approx(1000 * 131072 / 50e9)


def test_overlapped_reload_by_hand():
    """Llama-3.1-8B on H100: 32 layers, 131072 KV bytes per token, PCIe at 50 GB/s, so 1,000 tokens take
    R = 2.62144 ms to reload. Layer-wise, the iteration costs max(C + R/32, R + C/32) (head start h
    subtracted, never below C), not C + R."""
    m = LatencyModel("Llama-3.1-8B")
    assert m.reload_time(1000) == pytest.approx(2.62144e-3)
    assert m.overlapped_time(10e-3, 1000) == pytest.approx(10e-3 + 2.62144e-3 / 32)       # first copy shows
    assert m.overlapped_time(1e-3, 10000) == pytest.approx(26.2144e-3 + 1e-3 / 32)        # copy-bound
    assert m.overlapped_time(10e-3, 1000, head_start_s=5e-3) == pytest.approx(10e-3)      # reloaded ahead
    assert m.overlapped_time(1e-3, 10000, head_start_s=20e-3) == pytest.approx(26.2144e-3 + 1e-3 / 32 - 20e-3)
    assert m.overlapped_time(10e-3, 1000, head_start_s=-2e-3) == pytest.approx(12e-3 + 2.62144e-3 / 32)  # busy
    assert m.overlapped_time(7e-3, 0) == 7e-3


def test_pipelined_reload_matches_the_layer_by_layer_recurrence():
    rng = random.Random(0)
    for _ in range(500):
        layers = rng.randrange(1, 80)
        c, r, h = rng.uniform(0, 0.05), rng.uniform(0, 0.05), rng.uniform(-0.02, 0.05)
        end = 0.0
        for layer in range(layers):       # copy l arrives at (l+1)·R/L - h; layer l computes C/L after it
            end = max(end, (layer + 1) * r / layers - h) + c / layers
        assert pipelined_reload_s(c, r, layers, h) == pytest.approx(end, rel=1e-12, abs=1e-15)
        assert max(c, r) - max(h, 0) <= pipelined_reload_s(c, r, layers, h) <= c + r + max(-h, 0)


def test_engine_model_config_is_accepted():
    arch = get_model("Llama-3.1-8B")
    config = SimpleNamespace(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                             intermediate_size=14336, vocab_size=128256, sliding_window=None)
    a, b = LatencyModel(arch), LatencyModel(config)
    assert b.tp == 1
    assert a.iteration_time([(300, 700)], [50, 4000]) == b.iteration_time([(300, 700)], [50, 4000])


def test_bad_inputs_raise_value_errors_naming_them():
    m = LatencyModel("Llama-3.1-8B")
    with pytest.raises(ValueError, match="new_tokens"):
        m.iteration_time([(0, 10)], [])
    with pytest.raises(ValueError, match="cached"):
        m.iteration_time([(10, -1)], [])
    with pytest.raises(ValueError, match="decode_contexts"):
        m.iteration_time([], [10, 0])
    with pytest.raises(ValueError, match="tp"):
        LatencyModel("Llama-3.1-8B", tp=3)
    with pytest.raises(ValueError, match="unknown model"):
        LatencyModel("GPT-17")
    with pytest.raises(TypeError, match="num_layers"):
        LatencyModel(SimpleNamespace(hidden_size=1))
    with pytest.raises(ValueError, match="tokens"):
        m.prefill_time(0)


def _interp_log2(x, xs, ys):
    """Linear interpolation in log2(x) between table points, held at the ends (written here, not numpy)."""
    lx = math.log2(x)
    pts = [(math.log2(a), b) for a, b in zip(xs, ys)]
    if lx <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if lx <= x1:
            return y0 + (y1 - y0) * (lx - x0) / (x1 - x0)
    return pts[-1][1]


@pytest.mark.parametrize("q,c", [(256, 0), (256, 40960), (64, 8192), (2048, 0), (1000, 300), (7, 65536)])
def test_attention_cost_by_shape_matches_hand_computation(q, c):
    """Issue 25: the q x c rectangle at FA3's non-causal rate at length c+q, the triangle at its causal rate
    at length q, over the used share of the last 128-row block (GQA group packed), never below the KV read."""
    from shadowprefill.model import latency as L
    m = LatencyModel("Qwen2.5-7B")                     # 28 heads, 4 KV heads, head dim 128, tp 1
    peak = GPUS["h100"].peak_flops
    nc = _interp_log2(c + q, L.ATTN_SEQLENS, L.FA3_NONCAUSAL_TFLOPS) / 989.0
    ca = _interp_log2(q, L.ATTN_SEQLENS, L.FA3_CAUSAL_TFLOPS) / 989.0
    rows = q * 7
    used = rows / (128 * math.ceil(rows / 128))
    compute = 4 * 28 * 128 * (q * c / nc + q * (q + 1) / 2 / ca) / peak / used
    kv_read = (c + q) * 2 * 4 * 128 * 2 / (H100.gemm_bw_eff * GPUS["h100"].hbm_bw)
    assert m.attention_s(q, c) == pytest.approx(max(compute, kv_read), rel=1e-12)
    # an iteration holding the chunk pays it on every layer
    assert m.iteration_time([(q, c)], []) - m.iteration_time([(q, 0)], []) == pytest.approx(
        28 * (m.attention_s(q, c) - m.attention_s(q, 0)), rel=1e-9)


def test_flat_attention_option_is_the_half_peak_model():
    """attn_model="flat" keeps the earlier model: attn_flops_eff of peak for every shape, KV read added."""
    flat = dataclasses.replace(H100, attn_model="flat")
    m = LatencyModel("Qwen2.5-7B", cal=flat)
    q, c = 256, 40960
    expected = (4 * 28 * 128 * q * (c + (q + 1) / 2) / (0.5 * GPUS["h100"].peak_flops)
                + (c + q) * 2 * 4 * 128 * 2 / (H100.gemm_bw_eff * GPUS["h100"].hbm_bw))
    assert m.attention_s(q, c) == pytest.approx(expected, rel=1e-12)
    fa3 = LatencyModel("Qwen2.5-7B")
    assert fa3.attention_s(q, c) < m.attention_s(q, c)             # long keys: FA3 runs at ~65% of peak
    assert LatencyModel("Qwen2.5-7B", cal=dataclasses.replace(H100, attn_model="fa2")).attention_s(q, c) > \
        fa3.attention_s(q, c)
    with pytest.raises(ValueError, match="attn_model"):
        LatencyModel("Qwen2.5-7B", cal=dataclasses.replace(H100, attn_model="fa9"))
