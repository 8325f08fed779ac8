"""Per-layer roofline latency model of one continuous-batching iteration (paper appendix B).

An iteration holds prefill chunks (q new tokens on c cached ones) and decodes. Per layer:

- GEMMs (QKV, output projection, MLP up/gate and down, LM head) take the soft maximum of compute time
  and weight + activation read time, plus a fixed per-kernel cost: (compute^p + memory^p)^(1/p) + c0.
  p -> inf is the hard roofline max(compute, weight read); the fitted p models imperfect overlap.
- MoE layers compute with the active experts (T·k token-expert pairs) and read the weights of every
  expert the batch touches, E·(1-(1-k/E)^T) in expectation — active vs total parameters.
- Prefill attention does 4·H·D·q·(c + (q+1)/2) FLOPs and reads the c + q cached KV tokens; sliding-window
  layers cap the context at the window. Its rate depends on the shape (`attention_s`, issue 25): the
  q x c rectangle runs at FlashAttention-3's published non-causal forward rate at key length c + q, the
  q x q triangle at its causal rate at length q, a query block of fewer than 128 rows (after packing the
  GQA group) pays for the whole block, and the time is never below the KV read. `attn_model="flat"` keeps
  the earlier constant (`attn_flops_eff` of peak for every shape, KV read added).
- Decode attention reads each sequence's KV and adds a per-sequence cost.
- Elementwise ops (SiLU·mul, RMSNorms, RoPE, residual adds) are bandwidth-bound.
- Tensor parallelism splits heads and the intermediate size over `tp` GPUs and adds two all-reduces of
  T·hidden bf16 values per layer (ring: 2(w-1)/w of the bytes over NVLink).
- Host-tier reloads (`overlapped_time`) come back layer by layer over PCIe while earlier layers compute:
  an iteration of compute C reading a reload of R seconds costs max(C + R/L, R + C/L), not C + R
  (`pipelined_reload_s`).

Calibration (`H100`): GEMM, activation, norm and all-reduce constants were fitted by
`python -m shadowprefill.sim.calibrate --vidur-dir ../shared/data/vidur-h100` on the H100 operator
profiles of Vidur (microsoft/vidur, MIT: Llama-2-7B and Llama-2-70B at TP 1/2/4/8, 1-4096 tokens, and
h100_dgx all-reduce); the held-out median error of `linear_ops_ms` is 5.3% / 5.1% (numbers at `H100`).
KV reads stream at the fitted GEMM bandwidth efficiency. No attention profiles ship with that data: prefill
attention follows the published FlashAttention-3 forward rates (`FA3_*`, sources there), the per-sequence
/ per-iteration costs are assumptions, marked `assumed`. Other GPUs reuse the H100 efficiencies against
their own data-sheet peaks (the attention rates as fractions of the H100's 989 TFLOP/s).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Sequence

import numpy as np

from shadowprefill.model.gpus import GPUSpec, get_gpu
from shadowprefill.model.shape import ModelShape

DTYPE_BYTES = 2  # bf16 activations, KV and (dense) weights


@dataclass(frozen=True)
class Calibration:
    """Efficiencies (fractions of the GPU's peaks) and fixed costs of the roofline."""

    gemm_flops_eff: float
    gemm_bw_eff: float
    gemm_overhead_s: float
    gemm_softmax_p: float
    act_bw_eff: float             # SiLU·mul / GELU over the intermediate activations
    act_overhead_s: float
    norm_bw_eff: float            # 2 RMSNorms + RoPE + 2 residual adds per layer
    norm_overhead_s: float        # per elementwise kernel (5 per layer)
    allreduce_latency_s: tuple[tuple[int, float], ...]   # (workers, fixed latency)
    allreduce_bw_eff: float       # fraction of NVLink one-way bandwidth (ring bus bandwidth)
    attn_model: str = "fa3"              # "fa3" / "fa2": published kernel rates by shape; "flat": attn_flops_eff
    attn_flops_eff: float = 0.5          # "flat" model only (and linear-attention state updates): assumed
    decode_seq_s: float = 40e-9          # assumed: per decoding sequence per attention layer
    iteration_overhead_s: float = 0.5e-3  # assumed: scheduling, sampling, launch gaps per iteration
    per_seq_overhead_s: float = 2e-6     # assumed: per sequence per iteration (sampling, bookkeeping)
    source: str = ""


# Fitted by shadowprefill/sim/calibrate.py on ../shared/data/vidur-h100 (both Llama-2 models, all TPs).
# linear_ops_ms median error: 4.2% (Llama-2-7B), 4.7% (70B) in-sample; held out 5.3% (fit on 7B, test
# 70B) and 5.1% (fit on 70B, test 7B). All-reduce median error 10% / 3.8% / 3.8% at 2 / 4 / 8 GPUs.
H100 = Calibration(
    gemm_flops_eff=0.754, gemm_bw_eff=0.9615, gemm_overhead_s=5.692e-6, gemm_softmax_p=1.369,
    act_bw_eff=0.581, act_overhead_s=1.796e-6,
    norm_bw_eff=0.644, norm_overhead_s=1.738e-6,
    allreduce_latency_s=((2, 2.72e-5), (4, 2.70e-5), (8, 3.11e-5)), allreduce_bw_eff=0.7797,
    source="vidur-h100 Llama-2-7B + Llama-2-70B mlp profiles and h100_dgx all_reduce (microsoft/vidur)",
)


# Published H100-SXM5 forward attention rates, head dim 128, BF16, TFLOP/s by sequence length (batch x seqlen
# = 16K tokens, 2,048 = heads x head dim): FlashAttention-3 paper (Shah et al. 2024, arXiv 2407.08608),
# Figure 5, "Attention forward speed, head dim 128 (H100 80GB SXM5)", as transcribed (figure labels) on
# subtext.edge.nugit.net/image/e27582d2... (non-causal) and .../image/4ec6690918... (causal); the FA2 bars
# of the same figures are FlashAttention-2's. The two transcriptions of the non-causal 512 bar disagree
# (467 or 497; we take 467). A third measurement, pytorch/benchmark PR 2391 (FA3, same shapes, non-causal),
# reads 430 / 517 / 565 / 590 / 614 / 621: within 8% of the figure above 1K.
ATTN_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
FA3_NONCAUSAL_TFLOPS = (467, 565, 625, 638, 646, 648)
FA3_CAUSAL_TFLOPS = (292, 423, 521, 579, 602, 616)
FA2_NONCAUSAL_TFLOPS = (309, 350, 362, 368, 370, 370)
FA2_CAUSAL_TFLOPS = (191, 260, 298, 319, 333, 335)
H100_PEAK_TFLOPS = 989.0          # dense BF16, the denominator of the paper's "75% utilization" (740 TFLOP/s)
ATTN_BLOCK_M = 128                # query rows per thread block (FA2/FA3 at head dim 128): a partial block
                                  # costs a whole one; FA3 packs a GQA group's heads into the rows (pack_gqa)
ATTN_TABLES = {"fa3": (FA3_NONCAUSAL_TFLOPS, FA3_CAUSAL_TFLOPS), "fa2": (FA2_NONCAUSAL_TFLOPS, FA2_CAUSAL_TFLOPS)}
ATTN_MODELS = ("fa3", "fa2", "flat")


def _rate_table(tflops) -> tuple[np.ndarray, np.ndarray]:
    return np.log2(np.array(ATTN_SEQLENS, dtype=float)), np.array(tflops, dtype=float) / H100_PEAK_TFLOPS


def attention_eff(seqlen, kernel: str = "fa3", causal: bool = False):
    """Fraction of the bf16 peak the kernel's forward reaches at `seqlen` (interpolated in log2 length,
    held at the end points outside 512-16K)."""
    if kernel not in ATTN_TABLES:
        raise ValueError(f"kernel must be one of {sorted(ATTN_TABLES)}, got {kernel!r}")
    xs, ys = _rate_table(ATTN_TABLES[kernel][1 if causal else 0])
    return np.interp(np.log2(np.maximum(seqlen, 1.0)), xs, ys)


def soft_max(a, b, p: float):
    """(a^p + b^p)^(1/p): the roofline max(a, b) with imperfect overlap; works on floats and arrays."""
    return (a ** p + b ** p) ** (1.0 / p)


def gemm_s(m, n, k, gpu: GPUSpec, cal: Calibration = H100, weight_bits: float = 16.0):
    """Seconds of an [m, k] x [k, n] GEMM whose [k, n] operand is a weight stored at `weight_bits`."""
    compute = 2.0 * m * n * k / (cal.gemm_flops_eff * gpu.peak_flops)
    memory = (n * k * weight_bits / 8.0 + DTYPE_BYTES * (m * k + m * n)) / (cal.gemm_bw_eff * gpu.hbm_bw)
    return soft_max(compute, memory, cal.gemm_softmax_p) + cal.gemm_overhead_s


def act_s(tokens, width, gpu: GPUSpec, cal: Calibration = H100, gated: bool = True):
    """Seconds of the MLP activation over `width` intermediate features (gated: read 2, write 1)."""
    nbytes = (3 if gated else 2) * tokens * width * DTYPE_BYTES
    return nbytes / (cal.act_bw_eff * gpu.hbm_bw) + cal.act_overhead_s


def norm_ops_s(tokens, hidden, q_width, kv_width, gpu: GPUSpec, cal: Calibration = H100):
    """Seconds of one layer's 2 RMSNorms (read+write h), RoPE on q and k, and 2 residual adds (3h)."""
    nbytes = tokens * DTYPE_BYTES * (2 * 2 * hidden + 2 * (q_width + kv_width) + 2 * 3 * hidden)
    return nbytes / (cal.norm_bw_eff * gpu.hbm_bw) + 5 * cal.norm_overhead_s


def allreduce_s(nbytes, workers: int, gpu: GPUSpec, cal: Calibration = H100):
    """Seconds of a ring all-reduce of `nbytes` over `workers` GPUs (0 for one GPU)."""
    if workers <= 1:
        return 0.0 * nbytes
    latency = cal.allreduce_latency_s[0][1]
    for w, lat in cal.allreduce_latency_s:
        if w <= workers:
            latency = lat
    return latency + nbytes * 2.0 * (workers - 1) / workers / (cal.allreduce_bw_eff * gpu.nvlink_bw)


def pipelined_reload_s(compute_s, reload_s, num_layers: int, head_start_s=0.0):
    """Seconds of an iteration of `compute_s` compute whose forward reads KV reloaded layer by layer
    (issue 15): L = num_layers copies of r = reload_s / L each run in order on the side stream, layer l
    computes c = compute_s / L once layer l-1 finished and its own copy arrived. With h = head_start_s (the
    copy started that long before the iteration; negative: the side stream is busy -h longer):

        E_l = max(E_{l-1}, (l+1)·r - h) + c,  E_{-1} = 0
        T = E_{L-1} = max(L·c, max_j [(j+1)·r + (L-j)·c] - h) = max(C, max(C + R/L, R + C/L) - h)

    (C = compute_s, R = reload_s; the max over j of a linear function sits at j = 0, the first layer's copy
    exposed, or j = L-1, the copies bound and the last layer's compute exposed). So a reload shorter than
    the compute costs only R/L beyond it, a longer one C/L beyond the copy, never C + R."""
    return max(compute_s, max(compute_s + reload_s / num_layers, reload_s + compute_s / num_layers) - head_start_s)


def linear_ops_breakdown_s(hidden_size, intermediate_size, num_heads, num_kv_heads, num_tokens, tp=1,
                           gpu: "str | GPUSpec" = "h100", gated_mlp: bool = True, head_dim=None,
                           cal: Calibration = H100) -> dict[str, Any]:
    """One dense layer's five linear operators (Vidur op names) in seconds; arrays broadcast."""
    gpu = get_gpu(gpu)
    d = hidden_size // num_heads if head_dim is None else head_dim
    q_width = num_heads * d / tp
    kv_width = np.maximum(num_kv_heads / tp, 1) * d      # KV heads replicate when tp > num_kv_heads
    inter = intermediate_size / tp
    return {
        "attn_pre_proj": gemm_s(num_tokens, q_width + 2 * kv_width, hidden_size, gpu, cal),
        "attn_post_proj": gemm_s(num_tokens, hidden_size, q_width, gpu, cal),
        "mlp_up_proj": gemm_s(num_tokens, (2 if gated_mlp else 1) * inter, hidden_size, gpu, cal),
        "mlp_act": act_s(num_tokens, inter, gpu, cal, gated_mlp),
        "mlp_down_proj": gemm_s(num_tokens, hidden_size, inter, gpu, cal),
    }


def linear_ops_ms(hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int, num_tokens: int,
                  tp: int = 1, gpu: "str | GPUSpec" = "h100", gated_mlp: bool = True,
                  head_dim: int | None = None, cal: Calibration = H100) -> float:
    """Milliseconds of one layer's linear operators (QKV, output projection, MLP up/gate, activation, down)
    for `num_tokens` tokens at tensor-parallel degree `tp` — the sum of those five Vidur profile ops."""
    for name, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size),
                        ("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("num_tokens", num_tokens),
                        ("tp", tp)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    ops = linear_ops_breakdown_s(hidden_size, intermediate_size, num_heads, num_kv_heads, num_tokens, tp, gpu,
                                 gated_mlp, head_dim, cal)
    return float(sum(ops.values())) * 1e3


def _arch(arch: Any):
    """Resolve a catalog name to its ModelArch; other objects are read duck-typed."""
    if isinstance(arch, str):
        from shadowprefill.model.catalog import get_model
        return get_model(arch)
    for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                 "vocab_size"):
        if not isinstance(getattr(arch, name, None), (int, np.integer)):
            raise TypeError(f"arch must be a catalog name or have an int attribute {name!r}; "
                            f"got {type(arch).__name__}")
    return arch


def _hot_path_numbers(a: Any) -> SimpleNamespace:
    """The architecture numbers the hot path reads, taken once from a model description (a `ModelShape`:
    catalog `ModelArch` or engine `ModelConfig`, or an object with their attributes). A namespace, not a shape
    type; the attention widths are `ModelShape`'s (`_widths`)."""
    layers = int(a.num_layers)
    attn_layers = getattr(a, "num_attention_layers", None)
    attn_layers = layers if attn_layers is None else int(attn_layers)
    window = getattr(a, "sliding_window", None) or 0
    sliding = int(getattr(a, "sliding_window_layers", 0) or 0)
    if window and not hasattr(a, "sliding_window_layers"):
        sliding = attn_layers                           # e.g. an engine ModelConfig with a window
    s = SimpleNamespace(layers=layers, attn_layers=attn_layers, sliding_layers=sliding, window=int(window),
                        linear_layers=layers - attn_layers, hidden=int(a.hidden_size), heads=int(a.num_heads),
                        kv_heads=int(a.num_kv_heads), head_dim=int(a.head_dim),
                        inter=int(a.intermediate_size), vocab=int(a.vocab_size),
                        experts=int(getattr(a, "num_experts", 1) or 1),
                        top_k=int(getattr(a, "experts_per_token", 1) or 1),
                        shared_inter=int(getattr(a, "shared_expert_intermediate", 0) or 0),
                        gated=bool(getattr(a, "gated_mlp", True)), gate_q=bool(getattr(a, "attn_output_gate", False)),
                        linear_proj_params=int(getattr(a, "linear_attn_proj_params", 0) or 0),
                        state_bytes=int(getattr(a, "recurrent_state_bytes", 0) or 0),
                        expert_bits=float(getattr(a, "expert_weight_bits", 16.0) or 16.0))
    if hasattr(a, "weight_bytes") and callable(a.weight_bytes):
        s.weight_bytes = float(a.weight_bytes())
    else:
        s.weight_bytes = float(_count_params(s, *_widths(a))) * DTYPE_BYTES
    return s


def _widths(a: Any) -> tuple[int, int]:
    """(q_size, kv_size) of a model description, as `ModelShape` defines them (duck-typed objects too)."""
    return int(ModelShape.q_size.fget(a)), int(ModelShape.kv_size.fget(a))


def _count_params(s: SimpleNamespace, q_size: int, kv_size: int) -> int:
    """Parameters of a model from its hot-path numbers (when the description has no weight_bytes())."""
    attn = s.hidden * (q_size * (2 if s.gate_q else 1) + 2 * kv_size) + q_size * s.hidden
    mlp = (3 if s.gated else 2) * s.hidden * (s.inter * s.experts + s.shared_inter)
    return s.attn_layers * attn + s.linear_layers * s.linear_proj_params + s.layers * mlp + 2 * s.vocab * s.hidden


class LatencyModel:
    """Iteration latency of one model instance (`tp` GPUs) under the roofline above.

    `arch`: a catalog name ("Llama-3.1-8B", "Q2.5-7B"), a `ModelArch`, or any object with the engine
    `ModelConfig` attributes. `tp=None` applies the paper's rule (smallest of 1/2/4/8 GPUs at which weights
    take at most half the HBM). The engine's SimulatedExecutor and the shadow controller's predictor call
    `iteration_time(prefill, decode_contexts)` once per iteration, so it caches the per-token-count dense
    part and does O(#chunks) Python work plus two C-level sums over the decodes.
    """

    def __init__(self, arch: Any, gpu: "str | GPUSpec" = "h100", tp: int | None = None,
                 cal: Calibration = H100, activation_reserve_bytes: float = 2e9,
                 pcie_bw: float | None = None) -> None:
        self.arch = _arch(arch)
        self.gpu = get_gpu(gpu)
        self.pcie_bw = self.gpu.pcie_bw if pcie_bw is None else float(pcie_bw)
        if not self.pcie_bw > 0:
            raise ValueError(f"pcie_bw must be > 0, got {pcie_bw!r}")
        if not isinstance(cal, Calibration):
            raise TypeError(f"cal must be a Calibration, got {type(cal).__name__}")
        self.cal = cal
        s = self.shape = _hot_path_numbers(self.arch)
        self._q_size = _widths(self.arch)[0]
        if tp is None:
            tp = next((t for t in (1, 2, 4, 8) if s.weight_bytes / t <= 0.5 * self.gpu.hbm_bytes), None)
            if tp is None:
                raise ValueError(f"tp: {s.weight_bytes / 1e9:.0f} GB of weights need more than 8 GPUs")
        if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
            raise ValueError(f"tp must be a positive int, got {tp!r}")
        if s.heads % tp:
            raise ValueError(f"tp={tp} must divide num_heads={s.heads}")
        self.tp = tp
        self.activation_reserve_bytes = float(activation_reserve_bytes)
        bw = cal.gemm_bw_eff * self.gpu.hbm_bw
        kv_heads_gpu = max(s.kv_heads / tp, 1.0)
        self._kv_heads_gpu = kv_heads_gpu
        self._kv_layer_bytes = 2.0 * kv_heads_gpu * s.head_dim * DTYPE_BYTES       # per token, layer, GPU
        self._kv_read_s = self._kv_layer_bytes / bw                               # per token per layer
        self._attn_flop_s = 4.0 * s.heads / tp * s.head_dim / (cal.attn_flops_eff * self.gpu.peak_flops)
        if cal.attn_model not in ATTN_MODELS:
            raise ValueError(f"cal.attn_model must be one of {ATTN_MODELS}, got {cal.attn_model!r}")
        self._attn_flat = cal.attn_model == "flat"
        if not self._attn_flat:
            self._attn_tables = tuple(_rate_table(t) for t in ATTN_TABLES[cal.attn_model])
            self._attn_unit_s = 4.0 * s.heads / tp * s.head_dim / self.gpu.peak_flops   # per q·k pair at peak
            # query rows per token in a block: FA3 packs the GQA group (heads per KV head) into the rows
            self._attn_rows = s.heads // s.kv_heads if cal.attn_model == "fa3" else 1
        self._attn_cache: dict[tuple[int, int], float] = {}
        self._full_layers = s.attn_layers - s.sliding_layers
        self._state_s = 2.0 * s.state_bytes / tp / bw                             # read + write per seq
        self._state_flop_s = 2.0 * s.state_bytes / tp / (cal.attn_flops_eff * self.gpu.peak_flops)
        self._attn_launch_s = (s.attn_layers + s.linear_layers) * cal.gemm_overhead_s
        # per decoding sequence (attention layers + linear-attention state), per iteration, per sequence
        self._decode_seq_s = s.attn_layers * cal.decode_seq_s + s.linear_layers * self._state_s
        self._iteration_s, self._per_seq_s = cal.iteration_overhead_s, cal.per_seq_overhead_s
        self._dense: dict[int, float] = {}
        self._head: dict[int, float] = {}

    # ---- the hot path ----------------------------------------------------------------------------------
    def iteration_time(self, prefill: Sequence[tuple[int, int]], decode_contexts: Sequence[int]) -> float:
        """Seconds of one iteration: `prefill` = (new_tokens, cached_context_before_chunk) per chunk,
        `decode_contexts` = KV tokens each decoding sequence attends to. 0.0 for an empty batch."""
        n_dec = len(decode_contexts)
        s = self.shape
        tokens = n_dec
        attn = 0.0
        if prefill:
            units = kv_tokens = 0.0
            lin_tokens = 0
            window = s.window
            for q, c in prefill:
                if q <= 0 or c < 0:
                    raise ValueError(f"prefill chunks need new_tokens > 0 and cached >= 0, got {(q, c)}")
                tokens += q
                lin_tokens += q
                if not self._attn_flat:
                    attn += self._full_layers * self.attention_s(q, c)
                    if s.sliding_layers:
                        attn += s.sliding_layers * self.attention_s(q, min(c, window))
                    continue
                mid = c + (q + 1) * 0.5                                          # mean causal context
                units += self._full_layers * q * mid
                kv_tokens += self._full_layers * (c + q)
                if s.sliding_layers:
                    units += s.sliding_layers * q * min(mid, window)
                    kv_tokens += s.sliding_layers * (min(c, window) + q)
            attn += units * self._attn_flop_s + kv_tokens * self._kv_read_s
            if s.linear_layers:
                attn += s.linear_layers * (len(prefill) * self._state_s + lin_tokens * self._state_flop_s)
        if n_dec:
            if isinstance(decode_contexts, np.ndarray):
                total, smallest = int(decode_contexts.sum()), int(decode_contexts.min())
            else:
                total, smallest = sum(decode_contexts), min(decode_contexts)
            if smallest < 1:
                raise ValueError(f"decode_contexts must be >= 1, got {smallest}")
            kv = self._full_layers * total
            if s.sliding_layers:
                w = s.window
                if isinstance(decode_contexts, np.ndarray):
                    capped = int(np.minimum(decode_contexts, w).sum())
                elif smallest >= w:                                      # all beyond the window
                    capped = n_dec * w
                elif max(decode_contexts) <= w:                          # all within it
                    capped = total
                else:
                    capped = sum(c if c < w else w for c in decode_contexts)
                kv += s.sliding_layers * capped
            attn += kv * self._kv_read_s + n_dec * self._decode_seq_s
        if tokens == 0:
            return 0.0
        dense = self._dense.get(tokens)
        if dense is None:
            dense = self._dense[tokens] = self._dense_time(tokens)
        seqs = n_dec + len(prefill)
        head = self._head.get(seqs)
        if head is None:
            head = self._head[seqs] = float(gemm_s(seqs, s.vocab / self.tp, s.hidden, self.gpu, self.cal))
        return dense + head + attn + self._attn_launch_s + self._iteration_s + seqs * self._per_seq_s

    def attention_s(self, q: int, c: int) -> float:
        """Seconds of one attention layer's prefill of `q` new tokens after `c` cached ones on one GPU, by
        shape: the q x c rectangle at the kernel's non-causal rate at key length c + q, the q(q+1)/2
        triangle at its causal rate at length q, both divided by the used share of the last 128-row query
        block, never below the read of the c + q cached KV tokens. ("flat" model: `attn_flops_eff`.)"""
        if self._attn_flat:
            return q * (c + (q + 1) * 0.5) * self._attn_flop_s + (c + q) * self._kv_read_s
        key = (q, c)
        hit = self._attn_cache.get(key)
        if hit is not None:
            return hit
        (nc_x, nc_y), (ca_x, ca_y) = self._attn_tables
        rows = q * self._attn_rows
        used = rows / (ATTN_BLOCK_M * -(-rows // ATTN_BLOCK_M))
        rect = q * c / float(np.interp(math.log2(c + q), nc_x, nc_y)) if c else 0.0
        tri = q * (q + 1) * 0.5 / float(np.interp(math.log2(q), ca_x, ca_y))
        out = max((rect + tri) * self._attn_unit_s / used, (c + q) * self._kv_read_s)
        if len(self._attn_cache) < 200_000:
            self._attn_cache[key] = out
        return out

    def _dense_time(self, t: int) -> float:
        """All layers' projections, MLP/MoE, elementwise ops and all-reduces for `t` tokens."""
        s, g, c, tp = self.shape, self.gpu, self.cal, self.tp
        q_width = self._q_size / tp
        kv_width = self._kv_heads_gpu * s.head_dim
        attn_proj = (gemm_s(t, q_width * (2 if s.gate_q else 1) + 2 * kv_width, s.hidden, g, c)
                     + gemm_s(t, s.hidden, q_width, g, c))
        linear_proj = gemm_s(t, s.linear_proj_params / (tp * s.hidden), s.hidden, g, c) if s.linear_layers else 0.0
        up = (2 if s.gated else 1)
        if s.experts > 1:                                                        # MoE: active vs total
            pairs = t * s.top_k
            touched = s.experts * (1.0 - (1.0 - s.top_k / s.experts) ** t)
            inter = s.inter / tp
            p, bits = c.gemm_softmax_p, s.expert_bits
            flops_rate, bw = c.gemm_flops_eff * g.peak_flops, c.gemm_bw_eff * g.hbm_bw
            mlp = 0.0
            for n_out, k_in in ((up * inter, s.hidden), (s.hidden, inter)):
                compute = 2.0 * pairs * n_out * k_in / flops_rate
                memory = (touched * n_out * k_in * bits / 8 + DTYPE_BYTES * pairs * (n_out + k_in)) / bw
                mlp += soft_max(compute, memory, p) + c.gemm_overhead_s
            mlp += act_s(pairs, inter, g, c, s.gated) + gemm_s(t, s.experts, s.hidden, g, c)  # + router
            if s.shared_inter:
                shared = s.shared_inter / tp
                mlp += (gemm_s(t, up * shared, s.hidden, g, c) + act_s(t, shared, g, c, s.gated)
                        + gemm_s(t, s.hidden, shared, g, c))
        else:
            inter = s.inter / tp
            mlp = (gemm_s(t, up * inter, s.hidden, g, c) + act_s(t, inter, g, c, s.gated)
                   + gemm_s(t, s.hidden, inter, g, c))
        norms = norm_ops_s(t, s.hidden, q_width, kv_width, g, c)
        reduce = 2.0 * allreduce_s(t * s.hidden * DTYPE_BYTES, tp, g, c)
        return float(s.attn_layers * attn_proj + s.linear_layers * linear_proj + s.layers * (mlp + norms + reduce))

    # ---- helpers ---------------------------------------------------------------------------------------
    def prefill_time(self, tokens: int, cached: int = 0, chunk: int | None = None) -> float:
        """Seconds to prefill `tokens` new tokens after `cached` ones, alone on the instance, in one
        iteration (chunk=None) or in iterations of at most `chunk` tokens."""
        if tokens <= 0 or cached < 0:
            raise ValueError(f"tokens must be > 0 and cached >= 0, got tokens={tokens}, cached={cached}")
        if chunk is not None and chunk <= 0:
            raise ValueError(f"chunk must be > 0, got {chunk}")
        step = tokens if chunk is None else chunk
        total, done = 0.0, 0
        while done < tokens:
            q = min(step, tokens - done)
            total += self.iteration_time([(q, cached + done)], ())
            done += q
        return total

    def decode_time(self, batch: int, context: int) -> float:
        """Seconds of one decode-only iteration of `batch` sequences of `context` KV tokens each."""
        if batch <= 0 or context <= 0:
            raise ValueError(f"batch and context must be > 0, got batch={batch}, context={context}")
        return self.iteration_time((), np.full(batch, context, dtype=np.int64))

    def max_prefill_tokens(self, budget_s: float, prefill: Sequence[tuple[int, int]] = (),
                           decode_contexts: Sequence[int] = (), cached: int = 0, limit: int = 65536) -> int:
        """Largest n <= limit such that adding a chunk of n new tokens on `cached` keeps the iteration
        within `budget_s` (Algorithm 1 line 10); 0 if even one token does not fit."""
        base = list(prefill)
        lo, hi = 0, int(limit)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.iteration_time(base + [(mid, cached)], decode_contexts) <= budget_s:
                lo = mid
            else:
                hi = mid - 1
        return lo

    @property
    def weight_bytes_per_gpu(self) -> float:
        return self.shape.weight_bytes / self.tp

    @property
    def kv_bytes_per_token_per_gpu(self) -> float:
        return self._kv_layer_bytes * self.shape.attn_layers

    @property
    def kv_bytes_per_token(self) -> float:
        """KV bytes one token occupies on the whole instance (all GPUs, replicated KV heads counted)."""
        return self.kv_bytes_per_token_per_gpu * self.tp

    def max_kv_tokens(self, hbm_fraction: float = 0.9) -> int:
        """Tokens of KV that fit in `hbm_fraction` of each GPU's HBM after weights and activations."""
        if not 0 < hbm_fraction <= 1:
            raise ValueError(f"hbm_fraction must be in (0, 1], got {hbm_fraction}")
        free = hbm_fraction * self.gpu.hbm_bytes - self.weight_bytes_per_gpu - self.activation_reserve_bytes
        if self.kv_bytes_per_token_per_gpu == 0:
            return 0
        return max(0, int(free // self.kv_bytes_per_token_per_gpu))

    def host_transfer_time(self, tokens: int) -> float:
        """Seconds to move `tokens` of KV between HBM and host memory (each GPU over its own PCIe link at
        `pcie_bw`, the GPU's practical rate unless overridden)."""
        return tokens * self.kv_bytes_per_token_per_gpu / self.pcie_bw

    def reload_time(self, num_tokens: int) -> float:
        """Seconds the side stream needs to copy `num_tokens` of host-tier KV back (all layers): the
        host transfer time."""
        return self.host_transfer_time(num_tokens)

    def overlapped_time(self, compute_s: float, reload_tokens: int, head_start_s: float = 0.0) -> float:
        """Seconds of an iteration of `compute_s` compute that reads `reload_tokens` of KV reloaded layer by
        layer over the attention layers (`pipelined_reload_s` with R = reload_time(tokens), L = attention
        layers): max(C, max(C + R/L, R + C/L) - head_start_s); compute_s when nothing is reloaded. The
        SimulatedExecutor charges it for an iteration's reloads; the shadow controller's budget counts the
        part beyond the compute (jobs.take)."""
        if reload_tokens <= 0:
            return compute_s
        return pipelined_reload_s(compute_s, self.reload_time(reload_tokens), max(self.shape.attn_layers, 1),
                                  head_start_s)

    def energy_j(self, busy_s: float, idle_s: float = 0.0) -> float:
        """Energy proxy of the instance's `tp` GPUs from busy and idle time."""
        return self.tp * (busy_s * self.gpu.busy_w + idle_s * self.gpu.idle_w)

    def __repr__(self) -> str:
        name = getattr(self.arch, "name", type(self.arch).__name__)
        return f"LatencyModel({name!r}, gpu={self.gpu.name!r}, tp={self.tp})"
