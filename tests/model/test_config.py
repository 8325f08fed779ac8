"""ModelConfig: validation, presets, derived sizes, and the real-size configs of the model catalog."""
import dataclasses

import pytest
import torch

from shadowprefill.model.catalog import MODELS
from shadowprefill.model.config import ModelConfig, RopeScaling
from shadowprefill.model.llama import Llama


def _meta_param_count(config):
    return sum(p.numel() for p in Llama(config, device="meta").parameters())


def test_presets():
    small, large = ModelConfig.tiny(), ModelConfig.tiny_large()
    assert small.vocab_size == large.vocab_size           # the two demo models share token ids
    assert large.num_params > 3 * small.num_params
    assert small.num_heads % small.num_kv_heads == 0 and small.num_heads > small.num_kv_heads   # GQA
    tied = ModelConfig.tiny(tie_word_embeddings=True)
    assert tied.tie_word_embeddings and tied.num_params == small.num_params - small.vocab_size * small.hidden_size
    with pytest.raises(dataclasses.FrozenInstanceError):
        small.hidden_size = 3


@pytest.mark.parametrize("config", [
    ModelConfig.tiny(), ModelConfig.tiny_large(), ModelConfig.tiny(tie_word_embeddings=True),
    ModelConfig.tiny(qkv_bias=True, num_kv_heads=1)], ids=["tiny", "tiny-large", "tied", "bias"])
def test_num_params_counts_the_model(config):
    assert config.num_params == _meta_param_count(config)


def test_kv_bytes_per_token():
    c = ModelConfig.tiny()
    assert c.kv_bytes_per_token(2) == 2 * 2 * 2 * 16 * 2     # K and V x layers x kv heads x head_dim x bytes
    assert Llama(c, device="meta").kv_spec(16).page_bytes == 16 * c.kv_bytes_per_token(4)


@pytest.mark.parametrize("change, error, word", [
    (dict(vocab_size=0), ValueError, "vocab_size"),
    (dict(hidden_size=-4), ValueError, "hidden_size"),
    (dict(num_layers=2.0), TypeError, "num_layers"),
    (dict(num_heads=True), TypeError, "num_heads"),
    (dict(num_kv_heads=3), ValueError, "num_kv_heads"),
    (dict(head_dim=15), ValueError, "head_dim"),
    (dict(intermediate_size=0), ValueError, "intermediate_size"),
    (dict(max_position=0), ValueError, "max_position"),
    (dict(rope_theta=0.0), ValueError, "rope_theta"),
    (dict(rope_theta=float("inf")), ValueError, "rope_theta"),
    (dict(rms_norm_eps=0.0), ValueError, "rms_norm_eps"),
    (dict(tie_word_embeddings=1), TypeError, "tie_word_embeddings"),
    (dict(qkv_bias="yes"), TypeError, "qkv_bias"),
    (dict(sliding_window=0), ValueError, "sliding_window"),
    (dict(rope_scaling={"factor": 8}), TypeError, "rope_scaling"),
])
def test_validation_names_the_field(change, error, word):
    with pytest.raises(error, match=word):
        ModelConfig.tiny(**change)


def test_rope_scaling_validation():
    with pytest.raises(ValueError, match="kind"):
        RopeScaling("yarn", 4.0)
    with pytest.raises(ValueError, match="factor"):
        RopeScaling("linear", 0.0)
    with pytest.raises(ValueError, match="low_freq_factor"):
        RopeScaling("llama3", 8.0, 4.0, 1.0)


# Llama-style dense decoders of the catalog; the rest (MoE, softcaps, GELU MLP, linear attention) are refused.
SUPPORTED = {"Llama-3.1-8B", "Llama-3.1-70B", "Llama-3.3-70B", "Qwen2.5-7B", "Qwen2.5-72B", "SWE-agent-LM-7B",
             "SWE-agent-LM-32B", "Mistral-7B", "Mistral-Nemo-12B", "Gemma-7B"}


def test_from_arch_builds_every_dense_catalog_entry():
    assert SUPPORTED <= set(MODELS)
    for name, arch in MODELS.items():
        if name not in SUPPORTED:
            with pytest.raises(ValueError, match="not supported"):
                ModelConfig.from_arch(name)
            continue
        config = ModelConfig.from_arch(name)
        assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                config.intermediate_size, config.vocab_size, config.qkv_bias, config.tie_word_embeddings,
                config.rope_theta, config.max_position) == (
            arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim,
            arch.intermediate_size, arch.vocab_size, arch.qkv_bias, arch.tie_word_embeddings,
            arch.rope_theta, arch.max_position), name
        assert config.name == name
        # the parameter count the paper prints (Table 3) within rounding
        assert abs(config.num_params / 1e9 - arch.params_b) < 0.02 * arch.params_b, name
    with pytest.raises(ValueError, match="unknown architecture"):
        ModelConfig.from_arch("GPT-17")


def test_from_arch_paper_models_on_meta_device():
    # Published parameter counts: Llama-3.1-8B 8,030,261,248; Qwen2.5-7B 7,615,616,512 (q/k/v biases).
    llama = ModelConfig.from_arch("Llama-3.1-8B")
    qwen = ModelConfig.from_arch("Qwen2.5-7B")
    assert llama.num_params == 8_030_261_248
    assert qwen.qkv_bias and qwen.num_params == 7_615_616_512
    model = Llama(qwen, dtype=torch.bfloat16, device="meta")       # nothing is allocated
    assert sum(p.numel() for p in model.parameters()) == qwen.num_params
    assert ModelConfig.from_arch("Qwen2.5-7B", num_layers=2).num_layers == 2
