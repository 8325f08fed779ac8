"""paged_attention_kv and write_kv_cache on every engine layout they promise (DESIGN.md §4), both backends.

Each test builds one random block-major pool (NaN in the unwritten tails), copies the same K/V into a
layout's own cache tensor, and runs the engine-neutral op on that layout's views: the output must match the
float64 reference computed on the block-major pool, and writes must land exactly where the block-major
write_kv puts them (checked with the test-only loop oracle), nowhere else.
"""
import pytest
import torch

import reference
from shadowprefill import ops

from shadowprefill.ops.testing import nan_pool, random_batch
from .matrix import TRITON_DTYPES

MIXED = [(36, 1), (15, 1), (21, 7), (0, 19)]
LAYOUTS = ["vllm", "flashinfer-nhd", "flashinfer-hnd", "block-major", "mixed-strides"]


def layout_views(pool, layer, layout):
    """(storage, key_cache, value_cache): layer `layer` of the block-major pool copied into `layout`, and
    the [num_blocks, block_size, Hkv, D] views an engine of that layout would pass."""
    k, v = pool[:, layer, 0], pool[:, layer, 1]                      # [nb, Hkv, bs, D]
    if layout == "vllm":                                             # [2, nb, bs, Hkv, D]
        kv = torch.stack([k.transpose(1, 2), v.transpose(1, 2)]).contiguous()
        return kv, kv[0], kv[1]
    if layout == "flashinfer-nhd":                                   # [nb, 2, bs, Hkv, D]
        kv = torch.stack([k.transpose(1, 2), v.transpose(1, 2)], dim=1).contiguous()
        return kv, kv[:, 0], kv[:, 1]
    if layout == "flashinfer-hnd":                                   # [nb, 2, Hkv, bs, D]
        kv = torch.stack([k, v], dim=1).contiguous()
        return kv, kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2)
    if layout == "block-major":                                      # this project's page
        kv = pool.clone()
        return kv, kv[:, layer, 0].transpose(1, 2), kv[:, layer, 1].transpose(1, 2)
    key = k.transpose(1, 2).contiguous()                             # NHD keys, HND values: two tensors
    value = v.clone()
    return (key, value), key, value.transpose(1, 2)


def block_major_of(key_cache, value_cache, like, layer):
    """The views' contents written back into a copy of the block-major pool `like` (for comparisons)."""
    out = like.clone()
    out[:, layer, 0] = key_cache.transpose(1, 2)
    out[:, layer, 1] = value_cache.transpose(1, 2)
    return out


def bits(x):
    return x.view(torch.int16) if x.element_size() == 2 else x.view(torch.int32)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [d for d in TRITON_DTYPES if d != torch.float32])
def test_paged_attention_kv_matches_the_block_major_reference(backend, device, layout, dtype):
    pool = nan_pool(24, 2, 2, 16, 64, dtype, device)
    batch = random_batch(MIXED, pool, layer=1, num_q_heads=4)
    ref = reference.attention(**batch, sliding_window=20, softcap=8.0)
    _, key_cache, value_cache = layout_views(pool, 1, layout)
    out = torch.full_like(batch["q"], float("nan"))
    result = ops.paged_attention_kv(batch["q"], key_cache, value_cache, batch["block_table"], batch["cu_seqlens_q"],
                                    batch["seq_lens"], batch["scale"], out=out, sliding_window=20, softcap=8.0)
    assert result is out
    reference.assert_close_to_reference(out, ref, dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_kv_cache_writes_exactly_the_slots(backend, device, layout):
    pool = torch.randn(12, 2, 2, 3, 16, 80).to(device)                # 3 kv heads, head_dim 80: padded tiles
    pool[5, :, :, :, 9:] = float("nan")                               # unwritten tails stay untouched
    key, value = torch.randn(30, 3, 80).to(device), torch.randn(30, 3, 80).to(device)
    slots = torch.randperm(12 * 16)[:30]
    slots[::7] = -1
    expected = reference.write_kv(pool.cpu(), key.cpu(), value.cpu(), 0, slots)
    storage, key_cache, value_cache = layout_views(pool, 0, layout)
    ops.write_kv_cache(key, value, key_cache, value_cache, slots.to(device))
    got = block_major_of(key_cache.cpu(), value_cache.cpu(), pool.cpu(), 0)
    assert torch.equal(bits(got), bits(expected))


def test_block_major_ops_are_the_layout_ops_on_page_views(backend, device):
    """paged_attention / write_kv give bit-identical results to the *_kv ops on kv[:, layer, k].transpose."""
    pool = nan_pool(24, 2, 2, 16, 64, torch.float16, device)
    batch = random_batch(MIXED, pool, layer=1, num_q_heads=4)
    a = ops.paged_attention(**batch)
    k, v = pool[:, 1, 0].transpose(1, 2), pool[:, 1, 1].transpose(1, 2)
    b = ops.paged_attention_kv(batch["q"], k, v, batch["block_table"], batch["cu_seqlens_q"], batch["seq_lens"],
                               batch["scale"])
    assert torch.equal(a, b)
    key = torch.randn(5, 2, 64).half().to(device)
    slots = torch.tensor([3, 40, -1, 77, 100], device=device)
    other = pool.clone()
    ops.write_kv(key, key * 2, pool, 0, slots)
    ops.write_kv_cache(key, key * 2, other[:, 0, 0].transpose(1, 2), other[:, 0, 1].transpose(1, 2), slots)
    assert torch.equal(bits(pool), bits(other))


def layout_args():
    kv = torch.randn(2, 8, 16, 2, 64)                                 # vLLM [2, nb, bs, Hkv, D]
    return dict(q=torch.randn(5, 4, 64), key_cache=kv[0], value_cache=kv[1],
                block_table=torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32),
                cu_seqlens_q=torch.tensor([0, 1, 5], dtype=torch.int32),
                seq_lens=torch.tensor([10, 20], dtype=torch.int32), scale=0.125)


def with_(base, **changes):
    return {**base, **changes}


L = layout_args()
LAYOUT_ERRORS = [
    (with_(L, key_cache=torch.randn(8, 16, 64, 2).transpose(2, 3)), ValueError, "key_cache: the last dimension"),
    (with_(L, value_cache=torch.randn(8, 16, 2, 32)), ValueError, "value_cache: shape"),
    (with_(L, value_cache=L["value_cache"].half()), TypeError, "value_cache"),
    (with_(L, key_cache=L["key_cache"][0]), ValueError, "key_cache"),
    (with_(L, key_cache=L["key_cache"].half(), value_cache=L["value_cache"].half()), TypeError, "key_cache"),
    (with_(L, q=torch.randn(5, 3, 64)), ValueError, "q: 3 query heads"),
    (with_(L, key_cache=None), TypeError, "key_cache"),
]


@pytest.mark.parametrize("args, error, match", LAYOUT_ERRORS)
def test_paged_attention_kv_rejects_bad_views(args, error, match):
    with pytest.raises(error, match=match):
        ops.paged_attention_kv(**args)


def test_write_kv_cache_rejects_bad_views():
    kv = torch.randn(2, 8, 16, 2, 64)
    key = torch.randn(3, 2, 64)
    slots = torch.tensor([0, 5, 9])
    with pytest.raises(ValueError, match="value_cache: is the same memory as key_cache"):
        ops.write_kv_cache(key, key, kv[0], kv[0], slots)
    with pytest.raises(ValueError, match="key: expected shape"):
        ops.write_kv_cache(torch.randn(3, 4, 64), key, kv[0], kv[1], slots)
    with pytest.raises(ValueError, match="slot_mapping: slot 128"):
        ops.write_kv_cache(key, key, kv[0], kv[1], torch.tensor([0, 128, 1]))
    with pytest.raises(ValueError, match="key_cache: the last dimension"):
        ops.write_kv_cache(key, key, kv[0].transpose(2, 3), kv[1].transpose(2, 3), slots)


def test_opcheck_and_compile_on_engine_layouts():
    """opcheck on vLLM and FlashInfer HND views; torch.compile(fullgraph) writing through kv[0] / kv[1]."""
    pool = nan_pool(16, 2, 2, 16, 64, torch.float32)
    batch = random_batch([(9, 1), (3, 6)], pool, layer=1, num_q_heads=4)
    pool.copy_(torch.where(pool.isnan(), torch.randn_like(pool), pool))  # opcheck compares with NaN != NaN
    sp = torch.ops.shadowprefill
    for layout in ("vllm", "flashinfer-hnd"):
        _, k, v = layout_views(pool, 1, layout)
        args = (batch["q"], k, v, batch["block_table"], batch["cu_seqlens_q"], batch["seq_lens"], 0.125,
                torch.empty_like(batch["q"]))
        torch.library.opcheck(sp.paged_attention_kv.default, args + (0, 0.0))
        torch.library.opcheck(sp.paged_attention_kv.default, args + (4, 30.0))
        key = torch.randn(3, 2, 64)
        torch.library.opcheck(sp.write_kv_cache.default, (key, key * 2, k, v, torch.tensor([40, -1, 200])))

    def step(q, key, kv, block_table, cu_seqlens_q, seq_lens, slots):
        ops.write_kv_cache(key, key * 2, kv[0], kv[1], slots)
        return ops.paged_attention_kv(q, kv[0], kv[1], block_table, cu_seqlens_q, seq_lens, 0.125, softcap=20.0)

    kv, _, _ = layout_views(pool, 1, "vllm")
    kv_compiled = kv.clone()
    key, slots = torch.randn(3, 2, 64), torch.tensor([40, -1, 200])
    args = (batch["block_table"], batch["cu_seqlens_q"], batch["seq_lens"], slots)
    eager = step(batch["q"], key, kv, *args)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(batch["q"], key, kv_compiled, *args)
    torch.testing.assert_close(compiled, eager)
    assert torch.equal(kv_compiled, kv)


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
def test_example_runs_on_vllm_and_flashinfer_caches(backend_name):
    """examples/kv_layouts.py (README) runs as documented and checks its own output."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the ops set it on a CPU machine
    env.update(SHADOWPREFILL_BACKEND=backend_name, CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, "examples/kv_layouts.py"], cwd=root, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("max |out - dense reference|") == 3 and result.stdout.strip().endswith("ok")
