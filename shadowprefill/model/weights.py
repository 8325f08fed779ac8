"""Local Hugging Face checkpoints (config.json + *.safetensors) for `Llama`: load and save. Nothing is
downloaded.

Supported families: Llama (`LlamaForCausalLM`, incl. Llama-3.1 RoPE scaling), Qwen2 (q/k/v biases) and
Mistral (sliding window). Hugging Face stores q/k/v and gate/up as separate matrices; `Llama` fuses them
(`qkv_proj`, `gate_up_proj`), so loading concatenates and saving splits. Every tensor is checked: a
missing, unexpected or mis-shaped tensor raises ValueError naming it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from shadowprefill.model.config import ModelConfig, RopeScaling
from shadowprefill.model.llama import Llama
from shadowprefill.model.safetensors_io import SafetensorsFile, save_file

_DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Fused parameter of `Llama` -> the Hugging Face tensors it concatenates along dim 0.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
# Tensors some checkpoints carry that the model recomputes or does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ------------------------------------------------------------------------------------------- config
def config_from_hf(hf: dict[str, Any], name: str = "custom") -> ModelConfig:
    """A `ModelConfig` from the dict of a Hugging Face config.json (llama / qwen2 / mistral)."""
    model_type = hf.get("model_type")
    if model_type not in ("llama", "qwen2", "mistral"):
        raise ValueError(f"config.json: model_type {model_type!r} is not supported (llama, qwen2, mistral)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act {hf.get('hidden_act')!r} is not supported (silu)")
    if hf.get("mlp_bias"):
        raise ValueError("config.json: mlp_bias=true is not supported")
    if model_type != "qwen2" and hf.get("attention_bias"):
        raise ValueError("config.json: attention_bias=true (biased o_proj) is not supported")
    try:
        hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
        sliding_window = None
        if model_type == "mistral":
            sliding_window = hf.get("sliding_window")
        elif model_type == "qwen2" and hf.get("use_sliding_window"):
            raise ValueError("config.json: Qwen2 use_sliding_window=true (per-layer windows) is not supported")
        return ModelConfig(
            vocab_size=hf["vocab_size"], hidden_size=hidden, num_layers=hf["num_hidden_layers"],
            num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hidden // heads, intermediate_size=hf["intermediate_size"],
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            max_position=hf.get("max_position_embeddings", 4096),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2", rope_scaling=_rope_scaling_from_hf(hf.get("rope_scaling")),
            sliding_window=sliding_window, name=name)
    except KeyError as e:
        raise ValueError(f"config.json: missing key {e.args[0]!r}") from e


def _rope_scaling_from_hf(rs: dict[str, Any] | None) -> RopeScaling | None:
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return RopeScaling("linear", float(rs["factor"]))
    if kind == "llama3":
        return RopeScaling("llama3", float(rs["factor"]), float(rs["low_freq_factor"]),
                           float(rs["high_freq_factor"]), int(rs["original_max_position_embeddings"]))
    raise ValueError(f"config.json: rope_scaling type {kind!r} is not supported (llama3, linear)")


def config_to_hf(config: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The Hugging Face config.json dict of `config` (LlamaForCausalLM, or Qwen2 / Mistral when needed)."""
    if config.qkv_bias and config.sliding_window is not None:
        raise ValueError("config: qkv_bias together with sliding_window has no Hugging Face equivalent")
    model_type, arch = (("qwen2", "Qwen2ForCausalLM") if config.qkv_bias
                        else ("mistral", "MistralForCausalLM") if config.sliding_window is not None
                        else ("llama", "LlamaForCausalLM"))
    rope_scaling = None
    if config.rope_scaling is not None:
        rs = config.rope_scaling
        rope_scaling = {"rope_type": rs.kind, "type": rs.kind, "factor": rs.factor}
        if rs.kind == "llama3":
            rope_scaling.update(low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor,
                                original_max_position_embeddings=rs.original_max_position)
    hf: dict[str, Any] = {
        "architectures": [arch], "model_type": model_type, "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim, "hidden_act": "silu",
        "max_position_embeddings": config.max_position, "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta, "rope_scaling": rope_scaling,
        "tie_word_embeddings": config.tie_word_embeddings, "attention_bias": False, "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."), "initializer_range": 0.02, "use_cache": True,
    }
    if model_type == "mistral":
        hf["sliding_window"] = config.sliding_window
    if model_type == "qwen2":
        hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.num_layers)
    return hf


def read_config(path: str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` of a checkpoint directory's config.json."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ValueError(f"path: {file} not found (a checkpoint directory holds config.json + *.safetensors)")
    return config_from_hf(json.loads(file.read_text()), name=Path(path).name)


# ------------------------------------------------------------------------------------------ weights
def _hf_parts(param_name: str, config: ModelConfig) -> list[tuple[str, int]]:
    """The Hugging Face tensors (name, rows) that make up our parameter `param_name`, in dim-0 order."""
    for fused, parts in _FUSED.items():
        marker = f".{fused}."
        if marker in param_name:
            prefix, suffix = param_name.split(marker)
            rows = ((config.q_size, config.kv_size, config.kv_size) if fused.endswith("qkv_proj")
                    else (config.intermediate_size, config.intermediate_size))
            return [(f"{prefix}.{part}.{suffix}", n) for part, n in zip(parts, rows)]
    return [(param_name, -1)]


def load_weights(model: Llama, path: str | os.PathLike) -> None:
    """Copy the tensors of the *.safetensors files in directory `path` into `model` (converting dtype).

    Raises ValueError naming the tensor when one is missing, unexpected or of the wrong shape.
    """
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"path: no *.safetensors files in {path}")
    where: dict[str, SafetensorsFile] = {}
    for file in files:
        shard = SafetensorsFile(file)
        for name in shard.names():
            if name in where:
                raise ValueError(f"checkpoint tensor {name!r} appears in both {where[name].path} and {file}")
            where[name] = shard
    used: set[str] = set()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            row = 0
            for hf_name, rows in _hf_parts(param_name, model.config):
                if hf_name not in where:
                    raise ValueError(f"checkpoint tensor {hf_name!r} is missing in {path}")
                target = param if rows < 0 else param.narrow(0, row, rows)
                found = where[hf_name].shape(hf_name)
                if found != tuple(target.shape):
                    raise ValueError(f"checkpoint tensor {hf_name!r} has shape {list(found)}, the model "
                                     f"expects {list(target.shape)}")
                target.copy_(where[hf_name].get(hf_name))
                used.add(hf_name)
                row += max(rows, 0)
    unexpected = [name for name in where if name not in used and not name.endswith(_IGNORED_SUFFIXES)
                  and not (name == "lm_head.weight" and model.config.tie_word_embeddings)]
    if unexpected:
        raise ValueError(f"checkpoint tensors not used by the model (architecture mismatch?): "
                         f"{sorted(unexpected)[:8]}")


def load_checkpoint(path: str | os.PathLike, dtype: torch.dtype | None = None,
                    device: torch.device | str = "cpu") -> Llama:
    """A `Llama` with config and weights from a local Hugging Face checkpoint directory.

    `dtype` defaults to the checkpoint's `torch_dtype` (float32 when absent).
    """
    config = read_config(path)
    if dtype is None:
        hf = json.loads((Path(path) / "config.json").read_text())
        dtype = _DTYPE_NAMES.get(hf.get("torch_dtype") or hf.get("dtype") or "float32", torch.float32)
    model = Llama(config, dtype=dtype, device=device, init=False)
    load_weights(model, path)
    return model


def hf_state_dict(model: Llama) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names (fused parameters split; a tied head omitted)."""
    out: dict[str, torch.Tensor] = {}
    for param_name, param in model.named_parameters():
        row = 0
        for hf_name, rows in _hf_parts(param_name, model.config):
            out[hf_name] = param.detach() if rows < 0 else param.detach().narrow(0, row, rows)
            row += max(rows, 0)
    return out


def save_checkpoint(model: Llama, path: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
    """Write `model` as a Hugging Face checkpoint directory: config.json + model.safetensors.

    `dtype` (default: the model's) is the stored dtype. The directory is created if needed.
    """
    if not isinstance(model, Llama):
        raise TypeError(f"model must be a Llama, got {type(model).__name__}")
    dtype = model.dtype if dtype is None else dtype
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.to(dtype) for name, t in hf_state_dict(model).items()}
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config_to_hf(model.config, dtype), indent=2) + "\n")
