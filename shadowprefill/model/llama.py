"""Llama-style decoder over a flattened variable-length batch, attending through the paged KV cache.

Per layer: RMSNorm -> fused QKV projection -> RoPE at each token's position -> a wait for this layer of
the host-tier reloads (`batch.kv_ready`: later layers' copies overlap this layer's compute) -> `ops.write_kv`
of the new tokens' K/V into their pages -> `ops.paged_attention` (causal, GQA) over the cached context ->
output projection -> residual; RMSNorm -> SwiGLU MLP -> residual. Logits are computed only for the rows the
batch asks for (`logits_indices`), so shadow-prefill chunks, which produce KV and no tokens, cost no LM
head. `reference_logits` runs the same weights densely, with its own causal attention, for tests.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch import nn

from shadowprefill import ops
from shadowprefill.model.config import ModelConfig
from shadowprefill.model.forward_batch import ForwardBatch
from shadowprefill.model.layers import Embedding, Linear, RMSNorm, SwiGLUMLP
from shadowprefill.model.rope import RotaryEmbedding, apply_rope

# attend(layer_id, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> attention output [T, Hq, D]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Attention(nn.Module):
    """Grouped-query self-attention; how K/V are stored and attended is the `attend` callback's job."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias, dtype, device)
        self.o_proj = Linear(self.q_size, config.hidden_size, False, dtype, device)

    def forward(self, layer_id: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: AttendFn) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        out = attend(layer_id, q, k, v)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, layer_id: int, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = Attention(config, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        h = x + self.self_attn(self.layer_id, self.input_layernorm(x), cos, sin, attend)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (named as in Hugging Face's `model.*` tensors)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(i, config, dtype, device) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)


class Llama(nn.Module):
    """A Llama / Qwen2 / Mistral-style causal LM for serving.

    `Llama(config, seed=0, dtype=torch.float32, device="cpu")` initialises random weights deterministically
    from `seed` (on `device`; `device="meta"` allocates nothing). `init=False` leaves the weights
    uninitialised, for `shadowprefill.model.weights.load_checkpoint` to fill.
    """

    def __init__(self, config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", init: bool = True) -> None:
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        self.config = config
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling, device)
        self.model = LlamaModel(config, dtype, device)
        self.lm_head = None if config.tie_word_embeddings else Linear(
            config.hidden_size, config.vocab_size, False, dtype, device)
        if init and self.device.type != "meta":
            self.init_weights(seed)

    @property
    def device(self) -> torch.device:
        """Where the weights live (e.g. `cuda:0`)."""
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' (and the KV cache's) dtype."""
        return self.model.embed_tokens.weight.dtype

    # ------------------------------------------------------------------------------------ weights
    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Random weights from `seed`: projections and the LM head N(0, 1/fan_in), norm gains N(1, 0.01),
        q/k/v biases N(0, 0.25), embeddings N(0, 1) (N(0, 1/hidden) when tied, as they are the LM head).

        With these scales activations and logits have about unit variance, so greedy decoding depends on
        the context instead of collapsing onto one token. Values are drawn in float32 on the model's
        device, so the same seed gives the same weights (up to rounding) in every dtype.
        """
        gen = torch.Generator(device=self.device).manual_seed(seed)

        def fill(param: torch.Tensor, std: float, mean: float = 0.0) -> None:
            draw = torch.empty(param.shape, dtype=torch.float32, device=self.device).normal_(generator=gen)
            param.copy_(draw.mul_(std).add_(mean))

        for name, param in self.named_parameters():
            if name.endswith("embed_tokens.weight"):
                fill(param, 1.0 / math.sqrt(param.shape[1]) if self.lm_head is None else 1.0)
            elif name.endswith("norm.weight"):           # RMSNorm gains
                fill(param, 0.1, mean=1.0)
            elif name.endswith(".bias"):                  # Qwen2 q/k/v biases
                fill(param, 0.5)
            else:                                         # [out, in] projections and the LM head
                fill(param, 1.0 / math.sqrt(param.shape[1]))

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The [vocab_size, hidden_size] output matrix (the embedding table when tied)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def kv_spec(self, block_size: int):
        """The `shadowprefill.kv.KVCacheSpec` of this model's paged KV cache with `block_size` pages."""
        from shadowprefill.kv import KVCacheSpec

        c = self.config
        return KVCacheSpec(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                           block_size=block_size, dtype=self.dtype)

    # ------------------------------------------------------------------------------------ forward
    def _decode_stack(self, token_ids: torch.Tensor, positions: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        x = self.model.embed_tokens(token_ids)
        cos, sin = self.rotary(positions)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attend)
        return x

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(self.model.norm(hidden), self.lm_head_weight).float()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Run one iteration's batch; writes the new tokens' K/V into `kv_cache` and returns the logits
        [len(batch.logits_indices), vocab_size] float32 of the requested rows."""
        if not isinstance(batch, ForwardBatch):
            raise TypeError(f"batch must be a ForwardBatch, got {type(batch).__name__}")
        self._check_kv_cache(kv_cache)
        if batch.input_ids.device != self.device:
            raise ValueError(f"batch is on {batch.input_ids.device}, the model on {self.device}")

        waits = batch.kv_ready

        def attend(layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            for copy in waits:                # layer-wise reload: this layer of its pages has arrived
                copy.wait(layer_id)
            ops.write_kv(k, v, kv_cache, layer_id, batch.slot_mapping)
            return ops.paged_attention(q, kv_cache, layer_id, batch.block_table, batch.cu_seqlens_q,
                                       batch.seq_lens, self.scale, sliding_window=self.config.sliding_window)

        hidden = self._decode_stack(batch.input_ids, batch.positions, attend)
        return self._logits(hidden[batch.logits_indices])

    def _check_kv_cache(self, kv_cache: torch.Tensor) -> None:
        if not isinstance(kv_cache, torch.Tensor):
            raise TypeError(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
        c = self.config
        want = (c.num_layers, 2, c.num_kv_heads)
        if kv_cache.dim() != 6 or tuple(kv_cache.shape[1:4]) != want or kv_cache.shape[5] != c.head_dim:
            raise ValueError(f"kv_cache must be [num_blocks, {c.num_layers}, 2, {c.num_kv_heads}, block_size, "
                             f"{c.head_dim}], got {tuple(kv_cache.shape)}")
        if kv_cache.dtype != self.dtype:
            raise TypeError(f"kv_cache dtype {kv_cache.dtype} differs from the model dtype {self.dtype}")
        if kv_cache.device != self.device:
            raise ValueError(f"kv_cache is on {kv_cache.device}, the model on {self.device}")

    @torch.inference_mode()
    def reference_logits(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Dense, no-cache forward of one sequence: logits [len, vocab_size] float32 at every position.

        Uses its own causal softmax attention in plain torch (not the paged ops), for tests.
        """
        ids = torch.as_tensor(token_ids, dtype=torch.int64, device=self.device)
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"token_ids must be a non-empty 1-D sequence, got shape {tuple(ids.shape)}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise ValueError(f"token_ids must lie in [0, {self.config.vocab_size})")
        length = ids.numel()
        group = self.config.num_heads // self.config.num_kv_heads
        query_pos = torch.arange(length, device=self.device)[:, None]
        key_pos = torch.arange(length, device=self.device)[None, :]
        visible = key_pos <= query_pos                                   # causal
        if self.config.sliding_window is not None:
            visible &= key_pos > query_pos - self.config.sliding_window

        def dense_attend(layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k = k.repeat_interleave(group, dim=1)                      # [L, Hq, D]: query head h uses h // group
            v = v.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * self.scale
            probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
            return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)

        positions = torch.arange(length, dtype=torch.int64, device=self.device)
        return self._logits(self._decode_stack(ids, positions, dense_attend))
