"""paged_attention Triton kernel against the float64 reference (tests/reference.py): the kernel-specific
cases the op matrix (tests/ops) does not reach: head dims 80/96/256, block sizes 64/128, GQA groups that
are not powers of two, the split-KV path (forced and chosen), the two-launch plan of mixed batches, long
prefills with sliding windows (tile skipping at both ends), and int64 page offsets.

Runs on CUDA when present, else on CPU under TRITON_INTERPRET=1 (tests/conftest.py). bf16 runs only on a
GPU: Triton 3.9's interpreter computes tl.dot on bf16 operands wrongly on the CPU machine.
"""
import pytest
import torch

import reference
from shadowprefill import triton_kernels as tk
from shadowprefill.triton_kernels import launch
from shadowprefill.ops.testing import nan_pool as _nan_pool, random_batch as build
from triton_batch import ATTENTION_DTYPES, DEVICE, HAS_CUDA


def nan_pool(*shape_and_dtype):
    return _nan_pool(*shape_and_dtype, device=DEVICE)

MIXED = [(20, 1), (9, 12), (0, 5), (33, 1)]  # decodes, a chunk on cached context, a fresh prefill


def run(batch, splits=None, window=None, softcap=None):
    """Kernel output (poisoned with NaN first) and the float64 reference."""
    out = torch.full_like(batch["q"], float("nan"))
    with launch.forced_splits(splits):
        tk.paged_attention(**batch, out=out, sliding_window=window or 0, softcap=softcap or 0.0)
    args = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in batch.items()}
    return out, reference.attention(**args, sliding_window=window, softcap=softcap)


def check(batch, dtype, **kwargs):
    out, ref = run(batch, **kwargs)
    reference.assert_close_to_reference(out, ref, dtype)


@pytest.mark.parametrize("head_dim", [80, 96, 256])
def test_head_dims_padded_and_large(head_dim):
    pool = nan_pool(24, 2, 2, 16, head_dim, torch.float32)
    check(build(MIXED, pool, layer=1, num_q_heads=4), torch.float32)


@pytest.mark.parametrize("block_size", [64, 128])
def test_large_block_sizes(block_size):
    pool = nan_pool(12, 1, 2, block_size, 64, torch.float16)
    check(build([(130, 1), (70, 9), (0, 33), (200, 1)], pool, layer=0, num_q_heads=4), torch.float16)


def test_gqa_group_not_power_of_two():
    pool = nan_pool(24, 1, 2, 16, 64, torch.float16)  # 6 query heads on 2 kv heads: group 3, padded to 4
    check(build(MIXED, pool, layer=0, num_q_heads=6), torch.float16)


@pytest.mark.parametrize("splits", [2, 7, 16])
def test_split_kv_forced_on_mixed_batch(splits):
    """The split path on decodes and prefill chunks alike; 16 splits leave some splits without keys."""
    pool = nan_pool(32, 1, 2, 16, 64, torch.float32)
    check(build([(90, 1), (9, 12), (0, 5), (150, 1)], pool, layer=0, num_q_heads=4), torch.float32,
          splits=splits)


def test_split_kv_with_window_and_softcap():
    pool = nan_pool(32, 1, 1, 16, 64, torch.float32)
    check(build([(100, 1), (60, 6)], pool, layer=0, num_q_heads=2, window=40), torch.float32, splits=4,
          window=40, softcap=3.0)


def test_split_chosen_for_few_long_decodes():
    """Two decodes over a wide block table: the plan splits (no forcing), the reduce merges exactly."""
    pool = nan_pool(128, 1, 2, 16, 64, torch.float32)
    batch = build([(700, 1), (1100, 1)], pool, layer=0, num_q_heads=4)
    batch["block_table"] = torch.cat([batch["block_table"], batch["block_table"][:, -1:].expand(2, 30)], 1)
    (plan,) = launch.plan_attention(2, 2, 64, 2, 2, batch["block_table"].shape[1] * 16, torch.float32,
                                    launch.device_limits(torch.device(DEVICE)))
    assert plan.num_splits > 1
    check(batch, torch.float32)


@pytest.mark.parametrize("context, chunk", [(1500, 40), (2100, 70)])
def test_split_chosen_for_a_short_chunk_on_a_long_context(context, chunk):
    """The shadow-prefill case in small: one prefill chunk whose query tiles fill far less than a wave, so
    the plan splits its keys (no forcing); each split covers part of every tile's causal key range."""
    pool = nan_pool(144, 1, 1, 16, 64, torch.float16)
    batch = build([(context, chunk)], pool, layer=0, num_q_heads=2)
    (plan,) = launch.plan_attention(chunk, 1, 64, 2, 1, batch["block_table"].shape[1] * 16, torch.float16,
                                    launch.device_limits(torch.device(DEVICE)))
    assert plan.tile.block_m >= 64 and plan.num_splits > 1  # a prefill tile, split
    check(batch, torch.float16)


def test_split_chosen_for_both_launches_of_a_shadow_step():
    """A decode and a short chunk on a long context in one batch (the shadow-prefill step): the plan
    splits the decode launch and the chunk's prefill launch; the results merge exactly."""
    pool = nan_pool(144, 1, 1, 16, 64, torch.float16)
    batch = build([(300, 1), (1500, 40)], pool, layer=0, num_q_heads=2)
    plans = launch.plan_attention(41, 2, 64, 2, 1, batch["block_table"].shape[1] * 16, torch.float16,
                                  launch.device_limits(torch.device(DEVICE)))
    assert len(plans) == 2 and all(p.num_splits > 1 for p in plans)
    check(batch, torch.float16)


def test_mixed_batch_uses_two_launches_that_cover_every_sequence():
    pool = nan_pool(24, 1, 2, 16, 64, torch.float16)
    batch = build(MIXED, pool, layer=0, num_q_heads=8)
    plans = launch.plan_attention(batch["q"].shape[0], len(MIXED), 64, 4, 2, 64, torch.float16, launch.H100_LIMITS)
    assert [p.num_splits for p in plans] == [1, 1] and plans[0].q_len_max + 1 == plans[1].q_len_min
    check(batch, torch.float16)


def test_tile_override_gives_the_same_result():
    """A tile sweep (tiles=...) changes the launch shape, never the result."""
    pool = nan_pool(24, 1, 2, 16, 64, torch.float32)
    batch = build([(40, 1), (9, 30), (0, 17)], pool, layer=0, num_q_heads=4)
    ref = reference.attention(**{k: (v.cpu() if torch.is_tensor(v) else v) for k, v in batch.items()})
    for tiles in ({"decode": "32x16w4s2", "prefill": "16x32w4s3"}, "prefill=64x16w8s4"):
        out = torch.full_like(batch["q"], float("nan"))
        tk.paged_attention(**batch, out=out, tiles=tiles)
        reference.assert_close_to_reference(out, ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("spec", ["32x16w4s3o", "32x16w4s3", "16x32w4s4o"])
def test_prefill_loop_variants_overlapped_and_not(dtype, spec):
    """The overlapped main loop ("o" tiles: the next tile's scores carried across steps, the last step's
    thrown away), the previous loop, and a small overlapped tile, on chunks whose unmasked key ranges hold
    0, 1 and several tiles, with a split and with window + softcap; all against the float64 oracle."""
    pool = nan_pool(48, 1, 2, 16, 64, dtype)
    batch = build([(100, 40), (16, 20), (0, 9), (33, 1)], pool, layer=0, num_q_heads=4)
    for kwargs in ({}, {"splits": 3}, {"window": 60, "softcap": 4.0}):
        out = torch.full_like(batch["q"], float("nan"))
        with launch.forced_splits(kwargs.get("splits")):
            tk.paged_attention(**batch, out=out, sliding_window=kwargs.get("window", 0),
                               softcap=kwargs.get("softcap", 0.0), tiles={"prefill": spec})
        ref = reference.attention(**{k: (v.cpu() if torch.is_tensor(v) else v) for k, v in batch.items()},
                                  sliding_window=kwargs.get("window"), softcap=kwargs.get("softcap"))
        reference.assert_close_to_reference(out, ref, dtype)


def test_overlapped_loop_with_padded_head_dim():
    """head_dim 80 (padded to 128 in the tile): the overlapped loop's unmasked loads mask the padding."""
    pool = nan_pool(24, 1, 2, 16, 80, torch.float16)
    batch = build([(70, 20), (40, 1)], pool, layer=0, num_q_heads=4)
    out = torch.full_like(batch["q"], float("nan"))
    tk.paged_attention(**batch, out=out, tiles={"prefill": "16x16w4s3o"})
    ref = reference.attention(**{k: (v.cpu() if torch.is_tensor(v) else v) for k, v in batch.items()})
    reference.assert_close_to_reference(out, ref, torch.float16)


@pytest.mark.parametrize("window", [24, 130])
def test_long_prefill_with_window_skips_tiles_on_both_sides(window):
    """A 150-token chunk on 200 cached tokens: many query tiles, each with its own key range; pages wholly
    before the window point at the NaN page, so loading any of them fails the test."""
    pool = nan_pool(40, 1, 1, 16, 64, torch.float32)
    check(build([(200, 150)], pool, layer=0, num_q_heads=2, window=window), torch.float32, window=window)


def test_sequences_without_new_tokens_are_never_read():
    pool = nan_pool(24, 1, 2, 16, 64, torch.float32)
    check(build([(20, 3), (40, 0), (0, 1), (16, 0), (16, 1)], pool, layer=0, num_q_heads=2),
          torch.float32)


def test_int64_page_offsets():
    """Pages beyond 2^31 elements: block id * page stride overflows int32. The pool is a lazily committed
    4.3 GB allocation of which the test writes a few pages only."""
    num_blocks = (1 << 20) + 64  # 2048-element pages: page offsets up to 2^31 + 131072
    try:
        pool = torch.empty((num_blocks, 1, 2, 1, 16, 64), dtype=torch.float16, device=DEVICE)
    except (RuntimeError, MemoryError) as e:
        pytest.skip(f"cannot reserve a 4.3 GB pool on this machine: {e}")
    ids = torch.randperm(64)[:24].add(num_blocks - 64).tolist()
    batch = build([(150, 1), (100, 9)], pool, layer=0, num_q_heads=2, block_ids=ids)  # masked + full tiles
    assert int(batch["block_table"].min()) * pool.stride(0) >= 2**31
    check(batch, torch.float16)
    check(batch, torch.float16, splits=2)


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
def test_dtypes_gqa8_window_softcap(dtype):
    pool = nan_pool(24, 1, 1, 32, 128, dtype)
    check(build(MIXED, pool, layer=0, num_q_heads=8, window=30), dtype, window=30, softcap=20.0)


@pytest.mark.skipif(not HAS_CUDA, reason="bf16 tl.dot is wrong in Triton 3.9's interpreter on this CPU; "
                                         "bf16 is covered on GPU runs only")
def test_bf16_relative_error_below_1e2_on_gpu():
    pool = nan_pool(64, 1, 8, 16, 128, torch.bfloat16)
    batch = build([(300, 1), (120, 64), (0, 40), (500, 1)], pool, layer=0, num_q_heads=32)
    out, ref = run(batch)
    assert bool(torch.isfinite(out).all())
    assert reference.relative_error(out.cpu(), ref) < 1e-2
