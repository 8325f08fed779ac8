"""The Llama model: paged forward (chunked prefill mixed with decodes over random block tables) against
the dense `reference_logits`, and `reference_logits` against an independent float64 forward."""
import math
import random

import pytest
import torch

from shadowprefill.model.config import ModelConfig, RopeScaling
from shadowprefill.model.forward_batch import ForwardBatch
from shadowprefill.model.layers import RMSNorm
from shadowprefill.model.llama import Llama
from shadowprefill.model.rope import RotaryEmbedding, apply_rope

from .dense_reference import dense_logits, hf_tensors_of, inv_freq, rotate

CONFIGS = {
    "gqa": ModelConfig.tiny(),                                                       # 4 q heads, 2 kv heads
    "mha-tied": ModelConfig.tiny(num_kv_heads=4, tie_word_embeddings=True),
    "mqa-bias": ModelConfig.tiny(num_kv_heads=1, qkv_bias=True, num_layers=1),
    "window-llama3": ModelConfig.tiny(sliding_window=7, rope_theta=500000.0,
                                      rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64)),
    "large": ModelConfig.tiny_large(),
}


def _poisoned_cache(model, block_size, num_blocks):
    cache = model.kv_spec(block_size).allocate(num_blocks, model.device)
    return cache.fill_(float("nan"))   # any read of an unwritten slot would turn the logits into NaN


def _serve(model, prompts, decode_tokens, block_size, num_blocks, rng):
    """Drive the paged forward like an engine: random prefill chunks, decodes mixed in, random pages.

    Returns per sequence its tokens and the logits the paged forward produced at each fed position.
    """
    cache = _poisoned_cache(model, block_size, num_blocks)
    free_pages = list(range(num_blocks))
    rng.shuffle(free_pages)
    seqs = [dict(tokens=list(p), prompt_len=len(p), cached=0, table=[], logits={}) for p in prompts]
    while True:
        active = [s for s in seqs if s["cached"] < s["prompt_len"] + decode_tokens]
        if not active:
            break
        step = rng.sample(active, k=rng.randint(1, len(active)))
        feeds = []
        for s in step:
            if s["cached"] < s["prompt_len"]:          # a prefill chunk of random size
                n = rng.randint(1, s["prompt_len"] - s["cached"])
            else:                                      # a decode of the last generated token
                n = 1
            feeds.append(s["tokens"][s["cached"]:s["cached"] + n])
            while len(s["table"]) * block_size < s["cached"] + n:
                s["table"].append(free_pages.pop())
        batch = ForwardBatch.from_sequences(feeds, [s["cached"] for s in step], [s["table"] for s in step],
                                            block_size, logits="all", vocab_size=model.config.vocab_size,
                                            device=model.device)
        logits = model(batch, cache)
        assert logits.shape == (batch.num_tokens, model.config.vocab_size) and logits.dtype == torch.float32
        row = 0
        for s, feed in zip(step, feeds):
            for i in range(len(feed)):
                s["logits"][s["cached"] + i] = logits[row + i]
            row += len(feed)
            s["cached"] += len(feed)
            if s["cached"] >= s["prompt_len"] and len(s["tokens"]) == s["cached"]:
                s["tokens"].append(int(logits[row - 1].argmax()))   # greedy
    return seqs


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_paged_forward_matches_reference(name, block_size):
    config = CONFIGS[name]
    model = Llama(config, seed=3)
    rng = random.Random(f"{name}-{block_size}")
    prompts = [[rng.randrange(config.vocab_size) for _ in range(n)] for n in (1, 9, 23, 37)]
    seqs = _serve(model, prompts, decode_tokens=4, block_size=block_size, num_blocks=40, rng=rng)
    for s in seqs:
        fed = s["tokens"][:-1]                        # the last greedy token was never fed
        ref = model.reference_logits(fed)
        got = torch.stack([s["logits"][p] for p in range(len(fed))])
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_paged_forward_on_triton_kernels(monkeypatch):
    """The same engine-like run on the Triton kernels (CUDA when present, else the CPU interpreter)."""
    monkeypatch.setenv("SHADOWPREFILL_BACKEND", "triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = ModelConfig.tiny(num_layers=1)
    model = Llama(config, seed=4, device=device)
    rng = random.Random(8)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(n)] for n in (3, 11)]
    seqs = _serve(model, prompts, decode_tokens=1, block_size=4, num_blocks=12, rng=rng)
    for s in seqs:
        fed = s["tokens"][:-1]
        got = torch.stack([s["logits"][p] for p in range(len(fed))])
        torch.testing.assert_close(got, model.reference_logits(fed), atol=1e-4 if device == "cpu" else 1e-3,
                                   rtol=0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_reference_matches_independent_float64(name):
    config = CONFIGS[name]
    model = Llama(config, seed=5)
    tokens = torch.randint(0, config.vocab_size, (29,)).tolist()
    want = dense_logits(hf_tensors_of(model), config, tokens)
    torch.testing.assert_close(model.reference_logits(tokens).double(), want, atol=1e-4, rtol=0)


def test_bfloat16_model():
    model = Llama(ModelConfig.tiny(), seed=6, dtype=torch.bfloat16)
    cache = _poisoned_cache(model, 16, 4)
    assert cache.dtype == torch.bfloat16
    tokens = torch.randint(0, 512, (20,)).tolist()
    first = model(ForwardBatch.from_sequences([tokens[:13]], [0], [[2, 0]], 16, logits="all"), cache)
    rest = model(ForwardBatch.from_sequences([tokens[13:]], [13], [[2, 0]], 16, logits="all"), cache)
    ref = model.reference_logits(tokens)
    assert ref.dtype == torch.float32
    torch.testing.assert_close(torch.cat([first, rest]), ref, atol=0.1, rtol=0.02)


def test_logits_rows_selection():
    model = Llama(ModelConfig.tiny(), seed=0)
    cache = _poisoned_cache(model, 4, 16)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    ref = [model.reference_logits(p) for p in prompts]
    batch = ForwardBatch.from_sequences(prompts, [0, 0], [[3, 9], [0]], 4, logits=[False, True])
    out = model(batch, cache)
    assert out.shape == (1, 512)
    torch.testing.assert_close(out[0], ref[1][-1], atol=1e-4, rtol=0)
    # A shadow-style chunk (KV only, no logits) followed by a decode that reads that KV.
    cache = _poisoned_cache(model, 4, 16)
    none = model(ForwardBatch.from_sequences([prompts[0][:4]], [0], [[3, 9]], 4, logits="none"), cache)
    assert none.shape == (0, 512)
    last = model(ForwardBatch.from_sequences([prompts[0][4:]], [4], [[3, 9]], 4, logits="last"), cache)
    torch.testing.assert_close(last[0], ref[0][-1], atol=1e-4, rtol=0)


def test_from_sequences_layout():
    batch = ForwardBatch.from_sequences([[1, 2, 3], [4]], [5, 0], [[7, 2], [4]], 4, logits="last")
    assert batch.positions.tolist() == [5, 6, 7, 0]
    assert batch.slot_mapping.tolist() == [2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 4 * 4 + 0]
    assert batch.cu_seqlens_q.tolist() == [0, 3, 4] and batch.seq_lens.tolist() == [8, 1]
    assert batch.block_table.tolist() == [[7, 2], [4, 0]] and batch.logits_indices.tolist() == [2, 3]
    assert batch.num_tokens == 4 and batch.num_seqs == 2


def test_rmsnorm_and_rope_match_formulas():
    x = torch.randn(6, 3, 16)
    norm = RMSNorm(16, 1e-5, torch.float32, "cpu")
    norm.weight.data.copy_(torch.randn(16))
    xd = x.double()
    want = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    torch.testing.assert_close(norm(x).double(), want, atol=1e-6, rtol=1e-6)

    scaling = RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    config = ModelConfig.tiny(rope_theta=500000.0, rope_scaling=scaling)
    rotary = RotaryEmbedding(16, 500000.0, scaling)
    torch.testing.assert_close(rotary.inv_freq.double(), inv_freq(config), atol=0, rtol=1e-6)
    positions = torch.tensor([0, 1, 5, 100, 3000, 7])
    cos, sin = rotary(positions)
    got = apply_rope(x, cos, sin)
    for h in range(3):
        torch.testing.assert_close(got[:, h].double(), rotate(x[:, h].double(), positions, inv_freq(config)),
                                   atol=1e-4, rtol=0)


def test_init_is_deterministic_and_not_degenerate():
    config = ModelConfig.tiny()
    a, b, c = Llama(config, seed=1), Llama(config, seed=1), Llama(config, seed=2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        assert not torch.equal(pa, pc), name
    bf16 = Llama(config, seed=1, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.model.layers[0].mlp.down_proj.weight.float(),
                               a.model.layers[0].mlp.down_proj.weight, atol=0.02, rtol=0.01)
    tokens = torch.randint(0, config.vocab_size, (64,)).tolist()
    logits = a.reference_logits(tokens)
    assert 0.3 < logits.std(dim=-1).mean() < 5.0
    assert len(set(logits.argmax(-1).tolist())) > 16      # greedy choice depends on the context


def test_meta_device_allocates_nothing():
    model = Llama(ModelConfig.tiny(), device="meta")
    assert model.device.type == "meta"
    assert all(p.is_meta for p in model.parameters())


def test_bad_inputs_are_rejected():
    model = Llama(ModelConfig.tiny(), seed=0)
    batch = ForwardBatch.from_sequences([[1, 2]], [0], [[0]], 4)
    with pytest.raises(ValueError, match="kv_cache"):
        model(batch, torch.zeros(4, 2, 2, 3, 4, 16))
    with pytest.raises(TypeError, match="kv_cache"):
        model(batch, torch.zeros(4, 2, 2, 2, 4, 16, dtype=torch.float16))
    with pytest.raises(TypeError, match="batch"):
        model({"input_ids": batch.input_ids}, _poisoned_cache(model, 4, 4))
    with pytest.raises(ValueError, match="block_tables"):
        ForwardBatch.from_sequences([[1, 2, 3, 4, 5]], [0], [[0]], 4)
    with pytest.raises(ValueError, match="new_token_ids"):
        ForwardBatch.from_sequences([[1, 999]], [0], [[0]], 4, vocab_size=512)
    with pytest.raises(ValueError, match="max_position"):
        ForwardBatch.from_sequences([[1]], [10], [[0, 1, 2]], 4, max_position=8)
    with pytest.raises(TypeError, match="positions"):
        ForwardBatch(batch.input_ids, batch.positions.int(), batch.slot_mapping, batch.block_table,
                     batch.cu_seqlens_q, batch.seq_lens, batch.logits_indices)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        ForwardBatch(batch.input_ids, batch.positions, batch.slot_mapping, batch.block_table,
                     batch.cu_seqlens_q[:1], batch.seq_lens, batch.logits_indices)
    with pytest.raises(ValueError, match="token_ids"):
        model.reference_logits([1, 512])
    with pytest.raises(TypeError, match="config"):
        Llama({"vocab_size": 3})
    assert math.isclose(model.scale, 0.25)
