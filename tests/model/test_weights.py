"""Checkpoints: the safetensors format, Hugging Face config / tensor naming, save -> load round trips and
clear errors on mismatched checkpoints."""
import json
import struct

import pytest
import torch

from shadowprefill.model.config import ModelConfig, RopeScaling
from shadowprefill.model.llama import Llama
from shadowprefill.model.safetensors_io import SafetensorsFile, save_file
from shadowprefill.model.weights import (config_from_hf, load_checkpoint, load_weights, read_config,
                                         save_checkpoint)

from .dense_reference import dense_logits, hf_tensors_of


def test_safetensors_round_trip_and_layout(tmp_path):
    tensors = {
        "a.f32": torch.randn(3, 5),
        "b.bf16": torch.randn(7).to(torch.bfloat16),
        "c.f16": torch.randn(2, 2, 3).half(),
        "d.i64": torch.randint(-9, 9, (4,)),
        "e.bool": torch.rand(5) > 0.5,
        "f.empty": torch.empty(0, 4),
        "g.scalar": torch.tensor(2.5, dtype=torch.float64),
        "h.strided": torch.randn(4, 6)[:, ::2],
    }
    path = tmp_path / "x.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    # The file follows the format: u64 header length, JSON header, data at aligned offsets.
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    assert header["__metadata__"] == {"format": "pt"}
    assert (8 + n) % 8 == 0
    assert header["b.bf16"]["dtype"] == "BF16" and header["b.bf16"]["shape"] == [7]
    begin, end = header["a.f32"]["data_offsets"]
    assert raw[8 + n + begin: 8 + n + end] == tensors["a.f32"].numpy().tobytes()
    f = SafetensorsFile(path)
    assert f.metadata == {"format": "pt"} and sorted(f.names()) == sorted(tensors)
    for name, t in tensors.items():
        got = f.get(name)
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), name


def test_safetensors_rejects_garbage(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", 4) + b"{no}")
    with pytest.raises(ValueError, match="header"):
        SafetensorsFile(bad)
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    short = tmp_path / "short.safetensors"
    short.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(ValueError, match="'w'"):
        SafetensorsFile(short)


CHECKPOINT_CONFIGS = {
    "llama": ModelConfig.tiny(),
    "tied": ModelConfig.tiny(tie_word_embeddings=True),
    "qwen2-bias": ModelConfig.tiny(qkv_bias=True, rope_theta=1e6, rms_norm_eps=1e-6),
    "mistral-window": ModelConfig.tiny(sliding_window=6),
    "llama3-rope": ModelConfig.tiny(rope_theta=500000.0, rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64)),
}


@pytest.mark.parametrize("name", list(CHECKPOINT_CONFIGS))
def test_save_load_round_trip(tmp_path, name):
    config = CHECKPOINT_CONFIGS[name]
    model = Llama(config, seed=11)
    save_checkpoint(model, tmp_path / name)
    assert read_config(tmp_path / name).replace(name=config.name) == config
    loaded = load_checkpoint(tmp_path / name)
    assert loaded.dtype == torch.float32 and loaded.config.replace(name=config.name) == config
    for (pname, a), b in zip(model.named_parameters(), loaded.parameters()):
        assert torch.equal(a, b), pname
    tokens = torch.randint(0, config.vocab_size, (21,)).tolist()
    assert torch.equal(model.reference_logits(tokens), loaded.reference_logits(tokens))


def test_save_in_bfloat16_and_load_into_float32(tmp_path):
    model = Llama(ModelConfig.tiny(), seed=2)
    save_checkpoint(model, tmp_path, dtype=torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load_checkpoint(tmp_path).dtype == torch.bfloat16
    loaded = load_checkpoint(tmp_path, dtype=torch.float32)
    for a, b in zip(model.parameters(), loaded.parameters()):
        assert torch.equal(a.to(torch.bfloat16).float(), b)


def _hand_made_qwen2(tmp_path):
    """A Qwen2-style checkpoint written by hand: HF names, separate q/k/v (+bias) and gate/up, 2 shards."""
    hf = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 96, "hidden_size": 32,
          "intermediate_size": 40, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "hidden_act": "silu", "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
          "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 128,
          "torch_dtype": "float32"}
    g = torch.Generator().manual_seed(7)

    def r(*shape, std=0.2):
        return torch.randn(*shape, generator=g) * std

    tensors = {"model.embed_tokens.weight": r(96, 32, std=1.0), "model.norm.weight": 1 + r(32),
               "lm_head.weight": r(96, 32)}
    for i in range(2):
        p = f"model.layers.{i}"
        tensors.update({
            f"{p}.input_layernorm.weight": 1 + r(32), f"{p}.post_attention_layernorm.weight": 1 + r(32),
            f"{p}.self_attn.q_proj.weight": r(32, 32), f"{p}.self_attn.q_proj.bias": r(32),
            f"{p}.self_attn.k_proj.weight": r(16, 32), f"{p}.self_attn.k_proj.bias": r(16),
            f"{p}.self_attn.v_proj.weight": r(16, 32), f"{p}.self_attn.v_proj.bias": r(16),
            f"{p}.self_attn.o_proj.weight": r(32, 32), f"{p}.mlp.gate_proj.weight": r(40, 32),
            f"{p}.mlp.up_proj.weight": r(40, 32), f"{p}.mlp.down_proj.weight": r(32, 40),
            f"{p}.self_attn.rotary_emb.inv_freq": torch.ones(4),     # old checkpoints carry it; ignored
        })
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[::2]}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({n: tensors[n] for n in names[1::2]}, tmp_path / "model-00002-of-00002.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return tensors


def test_load_hand_made_hf_checkpoint(tmp_path):
    tensors = _hand_made_qwen2(tmp_path)
    model = load_checkpoint(tmp_path)
    c = model.config
    assert (c.qkv_bias, c.head_dim, c.num_kv_heads, c.rope_theta, c.sliding_window) == (True, 8, 2, 1e6, None)
    tokens = torch.randint(0, 96, (17,)).tolist()
    want = dense_logits(tensors, c, tokens)
    torch.testing.assert_close(model.reference_logits(tokens).double(), want, atol=1e-4, rtol=0)
    # and the model's own HF view of its weights matches the files
    for name, t in hf_tensors_of(model).items():
        assert torch.equal(t, tensors[name]), name


def test_mismatched_checkpoints_are_rejected_naming_the_tensor(tmp_path):
    _hand_made_qwen2(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    # wrong intermediate size: the first MLP tensor checked is named
    bad = ModelConfig(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      intermediate_size=48, qkv_bias=True)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight.*\[40, 32\].*\[48, 32\]"):
        load_weights(Llama(bad, init=False), tmp_path)
    # fewer KV heads than the checkpoint
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight"):
        load_weights(Llama(bad.replace(intermediate_size=40, num_kv_heads=1), init=False), tmp_path)
    # a Llama (no q/k/v bias) reading a Qwen2 checkpoint: the biases are unexpected
    with pytest.raises(ValueError, match=r"q_proj\.bias"):
        load_weights(Llama(bad.replace(intermediate_size=40, qkv_bias=False), init=False), tmp_path)
    # a model with more layers than the checkpoint: a missing tensor
    with pytest.raises(ValueError, match=r"model\.layers\.2\.input_layernorm\.weight.*missing"):
        load_weights(Llama(bad.replace(intermediate_size=40, num_layers=3), init=False), tmp_path)
    with pytest.raises(ValueError, match="model_type"):
        config_from_hf({**hf, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope_scaling"):
        config_from_hf({**hf, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="num_hidden_layers"):
        config_from_hf({k: v for k, v in hf.items() if k != "num_hidden_layers"})
    with pytest.raises(ValueError, match="safetensors"):
        load_weights(Llama(ModelConfig.tiny(), init=False), tmp_path / "nowhere")


def test_hf_configs_of_the_three_families():
    llama31 = config_from_hf({
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"}})
    assert llama31.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192) and llama31.head_dim == 128
    assert llama31.num_params == 8_030_261_248          # Meta's published Llama-3.1-8B parameter count
    mistral = config_from_hf({"model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096,
                              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                              "num_key_value_heads": 8, "sliding_window": 4096})
    assert mistral.sliding_window == 4096 and not mistral.qkv_bias and mistral.rope_theta == 10000.0
    assert config_from_hf({"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
                           "num_hidden_layers": 1, "num_attention_heads": 2}).num_kv_heads == 2
