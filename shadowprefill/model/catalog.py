"""Model catalog: every model of the ShadowPrefill paper's Tables 3-4, their pairs and token prices.

Architectures are the public `config.json` values of each Hugging Face checkpoint (layers, hidden size,
heads, KV heads, head dim, intermediate size per expert, vocabulary, experts total / active, sliding
window, soft-capping). `params_b` / `active_params_b` are the totals the paper prints in Table 3 (billions;
Table 4 models: the model cards); `computed_params()` recounts them from the architecture, which tests
check against the table. No torch here: the engine builds its `ModelConfig` presets from `MODELS`.

Token prices (`price_input`, `price_output`, USD per 1M tokens) are approximate public serverless list
prices of 2025 (Together AI / provider pages) — an assumption, since the paper uses "each benchmark's
per-model prices" without listing them. Cached input is billed at 0.1x the input price (paper §5.1).

TP rule (paper §5.1, appendix B): the smallest of 1, 2, 4, 8 H100s at which weights take at most half the
HBM (80 GB -> 40e9 bytes of weights per GPU). GPT-OSS ships its expert weights in MXFP4 (4.25 bits per
parameter), which is why GPT-OSS-20B fits one H100 as the paper states.
"""
from __future__ import annotations

from dataclasses import dataclass

from shadowprefill.model.shape import ModelShape

CACHED_INPUT_FACTOR = 0.1   # cached input billed at 10% of uncached (paper §5.1)
TP_CHOICES = (1, 2, 4, 8)
H100_HBM_BYTES = 80e9


@dataclass(frozen=True)
class ModelArch(ModelShape):
    """Public architecture of one decoder LLM plus its token prices.

    `intermediate_size` is per expert for MoE models. `attention_layers` counts layers with softmax
    attention and a per-token KV cache (None: all layers); the other layers are linear-attention layers
    (Qwen3-Next's Gated DeltaNet) with `linear_attn_proj_params` projection weights and a fixed
    `recurrent_state_bytes` state per sequence. `sliding_window_layers` of the attention layers attend to
    the last `sliding_window` tokens only (Gemma-2, GPT-OSS).
    """

    name: str                       # catalog key, e.g. "Llama-3.1-8B"
    hf_id: str                      # Hugging Face checkpoint
    label: str                      # name in the paper's figures, e.g. "L3.1-8B"
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    params_b: float                 # total parameters (B), paper Table 3
    price_input: float              # USD per 1M uncached input tokens
    price_output: float             # USD per 1M output tokens
    active_params_b: float | None = None
    num_experts: int = 1            # 1 = dense MLP
    experts_per_token: int = 1
    shared_expert_intermediate: int = 0
    gated_mlp: bool = True          # SwiGLU / GeGLU (3 matrices) vs GELU MLP (2)
    attn_output_gate: bool = False  # Qwen3-Next: q projection also produces an output gate
    attention_layers: int | None = None
    linear_attn_proj_params: int = 0
    recurrent_state_bytes: int = 0
    sliding_window: int | None = None
    sliding_window_layers: int = 0
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    expert_weight_bits: float = 16.0
    max_position: int = 8192
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    qkv_bias: bool = False
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                      "vocab_size", "num_experts", "experts_per_token", "max_position"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelArch({self.name!r}).{field} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelArch({self.name!r}): num_heads {self.num_heads} is not a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"ModelArch({self.name!r}): experts_per_token > num_experts")
        if not 0 <= self.num_attention_layers <= self.num_layers:
            raise ValueError(f"ModelArch({self.name!r}).attention_layers must be in [0, num_layers]")
        if not 0 <= self.sliding_window_layers <= self.num_attention_layers:
            raise ValueError(f"ModelArch({self.name!r}).sliding_window_layers must be in [0, attention layers]")
        if self.sliding_window_layers and not self.sliding_window:
            raise ValueError(f"ModelArch({self.name!r}): sliding_window_layers needs a sliding_window")
        if not (self.params_b > 0 and self.price_input >= 0 and self.price_output >= 0):
            raise ValueError(f"ModelArch({self.name!r}): params_b must be > 0 and prices >= 0")

    # ---- structure -------------------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    @property
    def num_attention_layers(self) -> int:
        return self.num_layers if self.attention_layers is None else self.attention_layers

    @property
    def num_linear_attn_layers(self) -> int:
        return self.num_layers - self.num_attention_layers

    def attn_proj_params(self) -> int:
        """Q, K, V and output projection weights of one softmax-attention layer."""
        q_out = self.q_size * (2 if self.attn_output_gate else 1)
        return self.hidden_size * (q_out + 2 * self.kv_size) + self.q_size * self.hidden_size

    def expert_params(self) -> int:
        """Weights of one MLP expert (the whole MLP of a dense model)."""
        return (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size

    def shared_expert_params(self) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden_size * self.shared_expert_intermediate

    def mlp_params(self, active: bool = False) -> int:
        """MLP weights of one layer: all experts, or (active=True) the experts one token uses."""
        experts = self.experts_per_token if active else self.num_experts
        router = self.hidden_size * self.num_experts if self.is_moe else 0
        return experts * self.expert_params() + self.shared_expert_params() + router

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    def computed_params(self, active: bool = False) -> int:
        """Parameter count recomputed from the architecture (norms and biases omitted)."""
        attn = self.num_attention_layers * self.attn_proj_params()
        linear_attn = self.num_linear_attn_layers * self.linear_attn_proj_params
        mlp = self.num_layers * self.mlp_params(active)
        embed = self.vocab_size * self.hidden_size if active else self.embedding_params()
        return attn + linear_attn + mlp + embed

    # ---- memory ----------------------------------------------------------------------------------------
    def weight_bytes(self) -> float:
        """Bytes of all weights: bf16, except experts stored at `expert_weight_bits` (GPT-OSS: MXFP4)."""
        total = self.params_b * 1e9
        expert = self.num_layers * self.num_experts * self.expert_params() if self.is_moe else 0
        expert = min(expert, total)
        return (total - expert) * 2.0 + expert * self.expert_weight_bits / 8.0

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V bytes one token occupies over all attention layers (a paged pool stores every layer)."""
        return 2 * self.num_attention_layers * self.kv_size * dtype_bytes

    # ---- cost ------------------------------------------------------------------------------------------
    @property
    def price_cached_input(self) -> float:
        return self.price_input * CACHED_INPUT_FACTOR

    def token_cost(self, input_tokens: int, cached_tokens: int, output_tokens: int) -> float:
        """USD for one call: uncached input, cached input at 0.1x, output (counts are tokens)."""
        if not 0 <= cached_tokens <= input_tokens:
            raise ValueError(f"cached_tokens must be in [0, input_tokens={input_tokens}], got {cached_tokens}")
        if output_tokens < 0:
            raise ValueError(f"output_tokens must be >= 0, got {output_tokens}")
        uncached = input_tokens - cached_tokens
        return (uncached * self.price_input + cached_tokens * self.price_cached_input
                + output_tokens * self.price_output) / 1e6


def tp_degree(arch: ModelArch, hbm_bytes: float = H100_HBM_BYTES, choices: tuple[int, ...] = TP_CHOICES) -> int:
    """Smallest TP degree at which the weights take at most half of each GPU's HBM (paper §5.1)."""
    weights = arch.weight_bytes()
    for tp in choices:
        if weights / tp <= 0.5 * hbm_bytes:
            return tp
    raise ValueError(f"{arch.name}: {weights / 1e9:.1f} GB of weights do not fit half the HBM of "
                     f"{max(choices)} GPUs of {hbm_bytes / 1e9:.0f} GB")


def _llama(name, hf_id, label, layers, hidden, heads, kv, inter, vocab, params, price, **kw) -> ModelArch:
    return ModelArch(name=name, hf_id=hf_id, label=label, num_layers=layers, hidden_size=hidden, num_heads=heads,
                     num_kv_heads=kv, head_dim=kw.pop("head_dim", hidden // heads), intermediate_size=inter,
                     vocab_size=vocab, params_b=params, price_input=price[0], price_output=price[1], **kw)


_L31 = dict(rope_theta=500000.0, max_position=131072, rms_norm_eps=1e-5)
_QWEN = dict(rope_theta=1000000.0, max_position=32768, rms_norm_eps=1e-6, qkv_bias=True)
_MISTRAL = dict(rope_theta=1000000.0, rms_norm_eps=1e-5)
_GEMMA2 = dict(head_dim=256, sliding_window=4096, attn_logit_softcap=50.0, final_logit_softcap=30.0,
               max_position=8192, rms_norm_eps=1e-6, tie_word_embeddings=True)

MODELS: dict[str, ModelArch] = {m.name: m for m in (
    # Llama 3.x (GQA 8 KV heads)
    _llama("Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct", "L3.1-8B", 32, 4096, 32, 8, 14336, 128256,
           8.0, (0.18, 0.18), **_L31),
    _llama("Llama-3.1-70B", "meta-llama/Llama-3.1-70B-Instruct", "L3.1-70B", 80, 8192, 64, 8, 28672, 128256,
           70.6, (0.88, 0.88), **_L31),
    _llama("Llama-3.3-70B", "meta-llama/Llama-3.3-70B-Instruct", "L3.3-70B", 80, 8192, 64, 8, 28672, 128256,
           70.6, (0.88, 0.88), **_L31),
    # Qwen2.5 (and the SWE-agent fine-tunes of Qwen2.5-Coder, Table 4)
    _llama("Qwen2.5-7B", "Qwen/Qwen2.5-7B-Instruct", "Q2.5-7B", 28, 3584, 28, 4, 18944, 152064,
           7.6, (0.30, 0.30), **_QWEN),
    _llama("Qwen2.5-72B", "Qwen/Qwen2.5-72B-Instruct", "Q2.5-72B", 80, 8192, 64, 8, 29568, 152064,
           72.7, (1.20, 1.20), **_QWEN),
    _llama("SWE-agent-LM-7B", "SWE-bench/SWE-agent-LM-7B", "SWE-7B", 28, 3584, 28, 4, 18944, 152064,
           7.6, (0.30, 0.30), **_QWEN),
    _llama("SWE-agent-LM-32B", "SWE-bench/SWE-agent-LM-32B", "SWE-32B", 64, 5120, 40, 8, 27648, 152064,
           32.8, (0.80, 0.80), **_QWEN),
    # Mistral family
    _llama("Mistral-7B", "mistralai/Mistral-7B-Instruct-v0.3", "M-7B", 32, 4096, 32, 8, 14336, 32768,
           7.2, (0.20, 0.20), max_position=32768, **_MISTRAL),
    _llama("Mistral-Nemo-12B", "mistralai/Mistral-Nemo-Instruct-2407", "Nemo-12B", 40, 5120, 32, 8, 14336,
           131072, 12.2, (0.15, 0.15), head_dim=128, max_position=131072, **_MISTRAL),
    _llama("Mixtral-8x7B", "mistralai/Mixtral-8x7B-Instruct-v0.1", "Mx-8x7B", 32, 4096, 32, 8, 14336, 32000,
           46.7, (0.60, 0.60), active_params_b=12.9, num_experts=8, experts_per_token=2, max_position=32768,
           **_MISTRAL),
    _llama("Mixtral-8x22B", "mistralai/Mixtral-8x22B-Instruct-v0.1", "Mx-8x22B", 56, 6144, 48, 8, 16384, 32768,
           140.6, (1.20, 1.20), active_params_b=39.1, num_experts=8, experts_per_token=2, max_position=65536,
           **_MISTRAL),
    # Gemma (Gemma-7B: full multi-head attention, 458 KB of KV per token, paper §3.3)
    _llama("Gemma-7B", "google/gemma-7b-it", "G-7B", 28, 3072, 16, 16, 24576, 256000, 8.5, (0.20, 0.20),
           head_dim=256, max_position=8192, rms_norm_eps=1e-6, tie_word_embeddings=True),
    _llama("Gemma-2-9B", "google/gemma-2-9b-it", "G2-9B", 42, 3584, 16, 8, 14336, 256000, 9.2, (0.30, 0.30),
           sliding_window_layers=21, **_GEMMA2),
    _llama("Gemma-2-27B", "google/gemma-2-27b-it", "G2-27B", 46, 4608, 32, 16, 36864, 256000, 27.2,
           (0.80, 0.80), sliding_window_layers=23, **{**_GEMMA2, "head_dim": 128}),
    # Granite-34B-Code: GPTBigCode, multi-query attention, GELU MLP, learned positions
    _llama("Granite-34B-Code", "ibm-granite/granite-34b-code-instruct-8k", "Granite-34B", 88, 6144, 48, 1,
           24576, 49152, 33.7, (0.80, 0.80), gated_mlp=False, max_position=8192, tie_word_embeddings=True),
    # GPT-OSS: MoE with MXFP4 experts, alternating 128-token sliding-window layers
    _llama("GPT-OSS-20B", "openai/gpt-oss-20b", "OSS-20B", 24, 2880, 64, 8, 2880, 201088, 20.9, (0.05, 0.20),
           head_dim=64, active_params_b=3.6, num_experts=32, experts_per_token=4, expert_weight_bits=4.25,
           sliding_window=128, sliding_window_layers=12, max_position=131072, rope_theta=150000.0,
           qkv_bias=True),
    _llama("GPT-OSS-120B", "openai/gpt-oss-120b", "OSS-120B", 36, 2880, 64, 8, 2880, 201088, 116.8,
           (0.15, 0.60), head_dim=64, active_params_b=5.1, num_experts=128, experts_per_token=4,
           expert_weight_bits=4.25, sliding_window=128, sliding_window_layers=18, max_position=131072,
           rope_theta=150000.0, qkv_bias=True),
    # Qwen3-Next-80B-A3B: 1 gated-attention layer in 4, the rest Gated DeltaNet; 512 experts, 10 active + 1
    # shared. DeltaNet layer: in_proj_qkvz 2048x12288 + in_proj_ba 2048x64 + out_proj 4096x2048; state
    # 32 value heads x 128 x 128 (bf16) + conv state 3 x 8192 (bf16) per sequence.
    _llama("Qwen3-Next-80B-A3B", "Qwen/Qwen3-Next-80B-A3B-Instruct", "Q3N-80B", 48, 2048, 16, 2, 512, 151936,
           81.3, (0.15, 1.50), head_dim=256, active_params_b=3.8, num_experts=512, experts_per_token=10,
           shared_expert_intermediate=512, attn_output_gate=True, attention_layers=12,
           linear_attn_proj_params=2048 * 12288 + 2048 * 64 + 4096 * 2048,
           recurrent_state_bytes=32 * 128 * 128 * 2 + 3 * 8192 * 2, max_position=262144,
           rope_theta=10000000.0, rms_norm_eps=1e-6),
)}

LABELS: dict[str, str] = {m.label: m.name for m in MODELS.values()}
# Short labels of the testbed figures (Table 4, Figures 10-13).
ALIASES: dict[str, str] = {"Q7": "Qwen2.5-7B", "L8": "Llama-3.1-8B", "L70": "Llama-3.1-70B",
                           "S7": "SWE-agent-LM-7B", "S32": "SWE-agent-LM-32B", "Q72": "Qwen2.5-72B"}


def _pairs(*labels: str) -> dict[str, tuple[str, str]]:
    out = {}
    for label in labels:
        small, large = label.split("/")
        out[label] = (resolve_name(small), resolve_name(large))
    return out


def resolve_name(name: str) -> str:
    """Catalog key of a model given its key, figure label, testbed alias or Hugging Face id."""
    if not isinstance(name, str):
        raise TypeError(f"model name must be a str, got {type(name).__name__}")
    if name in MODELS:
        return name
    if name in LABELS:
        return LABELS[name]
    if name in ALIASES:
        return ALIASES[name]
    lowered = name.lower()
    for arch in MODELS.values():
        if lowered in (arch.name.lower(), arch.label.lower(), arch.hf_id.lower()):
            return arch.name
    raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)} (or labels {sorted(LABELS)})")


def get_model(name: str) -> ModelArch:
    """The `ModelArch` of a catalog key, figure label ("Q2.5-7B"), alias ("Q7") or Hugging Face id."""
    return MODELS[resolve_name(name)]


# Model pairs per workload, named as in the paper's figures (Table 3; SWE-bench and the FusionBench
# testbed labels from Table 4). Values are (small, large) catalog keys.
PAIRS: dict[str, dict[str, tuple[str, str]]] = {
    "xroutebench": _pairs("OSS-20B/OSS-120B", "OSS-20B/L3.3-70B", "L3.3-70B/OSS-120B", "Q2.5-7B/L3.3-70B",
                          "Q2.5-7B/Q3N-80B"),
    "fusionbench": _pairs("L3.1-8B/L3.1-70B", "L3.1-8B/Nemo-12B", "M-7B/L3.1-70B", "M-7B/Mx-8x22B",
                          "Q2.5-7B/L3.1-70B"),
    "router-r1": _pairs("L3.1-70B/Mx-8x22B", "L3.1-8B/L3.1-70B", "M-7B/G2-27B", "M-7B/L3.1-70B",
                        "Q2.5-7B/L3.1-70B", "Q2.5-7B/Mx-8x22B"),
    "ghcp-coding": _pairs("G2-9B/Granite-34B", "G2-9B/Mx-8x7B", "G-7B/Mx-8x7B", "L3.1-8B/L3.1-70B",
                          "M-7B/Mx-8x22B", "Q2.5-7B/L3.1-70B"),
    "swe-bench": _pairs("S7/S32", "S7/Q72"),
}
TESTBED_PAIRS: dict[str, tuple[str, str]] = _pairs("Q7/L70", "L8/L70", "S7/S32", "S7/Q72")


def get_pair(label: str, workload: str | None = None) -> tuple[str, str]:
    """(small, large) catalog keys of a pair label such as "Q2.5-7B/L3.1-70B" or "S7/S32"."""
    if not isinstance(label, str) or label.count("/") != 1:
        raise ValueError(f"pair label must look like 'SMALL/LARGE', got {label!r}")
    if workload is not None:
        if workload not in PAIRS:
            raise ValueError(f"unknown workload {workload!r}; known: {sorted(PAIRS)}")
        if label not in PAIRS[workload]:
            raise ValueError(f"pair {label!r} is not among {workload}'s pairs {sorted(PAIRS[workload])}")
        return PAIRS[workload][label]
    small, large = label.split("/")
    return resolve_name(small), resolve_name(large)
