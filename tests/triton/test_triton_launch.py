"""Launch planning of shadowprefill.triton_kernels.launch: tiles, the resource model, resident capacity,
KV splits, the longest-first program order and the tile overrides (pure Python, no kernels)."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from shadowprefill.triton_kernels import launch

H100 = launch.H100_LIMITS
BF16 = torch.bfloat16


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 8, 16, 32])
@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_tiles_are_valid_dot_tiles_that_fit_and_pipeline(head_dim, group, decode, dtype):
    tile = launch.attention_tile(head_dim, group, dtype, decode)
    assert tile.block_m >= 16 and tile.block_m == tile.block_q * tile.group_padded
    assert tile.group_padded >= group and tile.group_padded & (tile.group_padded - 1) == 0
    assert tile.head_dim_padded >= head_dim and tile.head_dim_padded & (tile.head_dim_padded - 1) == 0
    assert tile.block_n >= 16 and tile.block_q >= 1
    assert tile.num_stages >= 3  # page ids one tile ahead + 3 stages: two K/V tiles in flight
    assert launch.tile_resources(tile, dtype)[0] <= H100.smem_per_block
    if decode:
        assert tile.block_m == max(16, tile.group_padded)  # decode tiles stay small: the kernel reads K/V


def test_resource_model_matches_the_sm90_compile_of_the_bench_tiles():
    """bench/sm90_compile_report.py measured these (Triton 3.6 and 3.9): decode 71,680 B and 135-158
    registers; prefill 128x64w8s3o (the overlapped default) 147,456 B and 229-242 registers, 128x64w8s3
    (the previous loop) 131,072 B and 170-188, 64x32w4s4o 90,112 B and 181-182 (two CTAs per SM); the
    model may be above, never below."""
    decode = launch.attention_tile(128, 4, BF16, True)
    prefill = launch.attention_tile(128, 4, BF16, False)
    assert prefill.spec == "128x64w8s3o" and prefill.overlap
    smem, regs = launch.tile_resources(decode, BF16)
    assert 71680 <= smem <= 1.05 * 71680 and 158 <= regs <= 200
    for spec, compiled_smem, compiled_regs, ctas in (("128x64w8s3o", 147456, 242, 1), ("128x64w8s3", 131072, 188, 1),
                                                     ("64x32w4s4o", 90112, 182, 2)):
        tile = launch.attention_tile(128, 4, BF16, False, spec)
        assert tile.spec == spec
        smem, regs = launch.tile_resources(tile, BF16)
        assert compiled_smem <= smem <= 1.05 * compiled_smem and compiled_regs <= regs <= 255, spec
        assert launch.ctas_per_sm(tile, BF16) == ctas, spec
    assert launch.ctas_per_sm(decode, BF16) == 3


def test_tile_spec_overlap_suffix():
    assert launch.parse_tile("128x64w8s3o") == (128, 64, 8, 3, True)
    assert launch.parse_tile("128x64w8s3") == (128, 64, 8, 3, False)
    with pytest.raises(ValueError, match="prefill"):
        launch.parse_tile("128x64w8s3x", "prefill")
    assert not launch.attention_tile(128, 4, torch.float32, False).overlap  # fp32: 3-pass dots, no overlap
    assert not launch.attention_tile(128, 4, BF16, True).overlap            # decode tiles read K/V: no gain


def test_capacity_counts_the_tightest_resource():
    tile = launch.attention_tile(128, 4, BF16, True)
    assert launch.resident_capacity(tile, BF16) == 3 * 132                     # shared memory: 3 x 72 KB
    small = launch.DeviceLimits(sms=10, smem_per_sm=100 * 1024, smem_per_block=99 * 1024, regs_per_sm=65536,
                                max_threads_per_sm=2048)
    assert launch.resident_capacity(tile, BF16, small) == 10                   # one 72 KB CTA per SM
    few_regs = launch.DeviceLimits(sms=10, smem_per_sm=228 * 1024, smem_per_block=227 * 1024, regs_per_sm=32768,
                                   max_threads_per_sm=2048)
    assert launch.resident_capacity(tile, BF16, few_regs) == 10                # registers: 128 threads x 168


def test_splits_fill_one_wave_of_resident_ctas():
    # 1 x 128K decode, 8 kv heads: 8 programs, 396 resident decode CTAs -> 49 splits (not 132 / 8)
    assert launch.num_kv_splits(8, 131072, 396) == 49
    # 64 x 8K decode: 512 programs > one wave: no split
    assert launch.num_kv_splits(512, 8192, 396) == 1
    # short context: never below MIN_TOKENS_PER_SPLIT keys per split
    assert launch.num_kv_splits(8, 600, 396) == 1 and launch.num_kv_splits(8, 1024, 396) == 2
    # more than half a wave already: a split would spill into a second wave
    assert launch.num_kv_splits(200, 65536, 396) == 1 and launch.num_kv_splits(198, 65536, 396) == 2


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4096), st.integers(1, 1 << 20), st.integers(1, 4096))
def test_splits_never_exceed_one_wave_nor_the_minimum_split_length(programs, context, capacity):
    splits = launch.num_kv_splits(programs, context, capacity)
    assert 1 <= splits <= launch.MAX_SPLITS
    assert splits == 1 or (programs * splits <= capacity and context // splits >= launch.MIN_TOKENS_PER_SPLIT)


def test_plans_for_decodes_prefills_and_mixes():
    decode_tile = launch.attention_tile(128, 4, BF16, True)
    (plan,) = launch.plan_attention(1, 1, 128, 4, 8, 131072, BF16, H100)
    assert plan.tile == decode_tile and plan.num_splits == 49 and plan.programs == 8
    (plan,) = launch.plan_attention(256, 256, 128, 4, 8, 8192, BF16, H100)
    assert plan.tile == decode_tile and plan.num_splits == 1 and plan.programs == 2048
    # a 2,048-token prefill: 64 query tiles x 8 heads fill the GPU
    (plan,) = launch.plan_attention(2048, 1, 128, 4, 8, 32768, BF16, H100)
    assert plan.tile.block_m == 128 and plan.num_splits == 1 and plan.programs == 512
    # a mix: decode tile for q_len <= its block_q, prefill tile for the rest, no gap, no overlap
    decode, prefill = launch.plan_attention(2112, 65, 128, 4, 8, 16384, BF16, H100)
    assert (decode.q_len_min, decode.q_len_max) == (0, decode_tile.block_q)
    assert (prefill.q_len_min, prefill.q_len_max) == (decode_tile.block_q + 1, launch.Q_LEN_UNBOUNDED)
    assert decode.num_splits == 1 and prefill.num_splits == 1
    # a few decodes next to a long chunk: the decode launch (3 x 8 programs) is split on its own
    decode, prefill = launch.plan_attention(2050, 3, 128, 4, 8, 16384, BF16, H100)
    assert decode.programs == 24 and decode.num_splits == 16 and prefill.num_splits == 1
    # the shadow-prefill step: 64 decodes and a 256-token chunk on 32K: the chunk's launch is split
    decode, prefill = launch.plan_attention(64 + 256, 65, 128, 4, 8, 32768 + 256, BF16, H100)
    assert decode.num_splits == 1 and prefill.programs == 64 and prefill.num_splits == 2


@pytest.mark.parametrize("chunk, context, splits", [(128, 32768, 4), (256, 16384, 2), (256, 65536, 2),
                                                    (512, 65536, 1), (128, 300, 1)])
def test_short_chunks_on_long_contexts_split(chunk, context, splits):
    """The shadow-prefill case: a chunk of 128-256 new tokens launches 32-64 prefill CTAs (8 kv heads),
    fewer than one wave of 132 resident ones, so the keys are split; 512 tokens fill a wave already."""
    (plan,) = launch.plan_attention(chunk, 1, 128, 4, 8, context + chunk, BF16, H100)
    assert plan.tile.block_m == 128 and plan.num_splits == splits
    assert plan.programs * plan.num_splits <= launch.resident_capacity(plan.tile, BF16, H100)


def test_forced_splits_and_tiles():
    with launch.forced_splits(3):
        (plan,) = launch.plan_attention(2112, 65, 128, 4, 8, 16384, BF16, H100)
        assert plan.num_splits == 3 and plan.q_len_max == launch.Q_LEN_UNBOUNDED
    assert launch.forced_num_splits() is None
    with pytest.raises(ValueError, match="num_splits"):
        with launch.forced_splits(0):
            pass
    with launch.forced_tiles(prefill="64x32w4s4"):
        (plan,) = launch.plan_attention(2048, 1, 128, 4, 8, 32768, BF16, H100)
        assert plan.tile.spec == "64x32w4s4" and plan.tile.block_q == 16
    (plan,) = launch.plan_attention(2048, 1, 128, 4, 8, 32768, BF16, H100, tiles={"prefill": "128x32w8s3"})
    assert plan.tile.spec == "128x32w8s3"
    (plan,) = launch.plan_attention(64, 64, 128, 4, 8, 8192, BF16, H100, tiles="decode=32x64w4s4")
    assert plan.tile.spec == "32x64w4s4" and plan.tile.block_q == 8


def test_tile_overrides_precedence_and_errors(monkeypatch):
    monkeypatch.setenv(launch.TILES_ENV, "prefill=64x64w8s3")
    assert launch.tile_overrides() == {"prefill": "64x64w8s3"}
    with launch.forced_tiles(decode="16x32w4s3"):
        assert launch.tile_overrides() == {"decode": "16x32w4s3"}
        assert launch.tile_overrides({"prefill": "128x64w8s4"}) == {"prefill": "128x64w8s4"}
    for bad, match in (("prefill=128x64w8", "SHADOWPREFILL_ATTENTION_TILES"), ("prefill=96x64w8s3", "rows"),
                       ("prefil=128x64w8s3", "unknown tile kind"), ("prefill=128x64w8s9", "stages"),
                       ("prefill", "expected 'decode=SPEC")):
        monkeypatch.setenv(launch.TILES_ENV, bad)
        with pytest.raises(ValueError, match=match):
            launch.tile_overrides()
    with pytest.raises(TypeError, match="tiles"):
        launch.tile_overrides(3)
    monkeypatch.setenv(launch.SPLITS_ENV, "1000")
    with pytest.raises(ValueError, match=launch.SPLITS_ENV):
        launch.forced_num_splits()
    monkeypatch.setenv(launch.SPLITS_ENV, "4")
    assert launch.forced_num_splits() == 4


def kernel_program_map(q_lens, block_q, num_kv_heads, num_splits):
    """The kernel's program id -> (sequence, tile, head, split), replayed in Python (attention.py: flat
    reversed grid, then the binary search over cu_seqlens_q); None for spare programs."""
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    grid = launch.num_query_tiles(cu[-1], len(q_lens), block_q) * num_kv_heads * num_splits
    order = []
    for program in range(grid):
        pid = grid - 1 - program
        split, pid = pid % num_splits, pid // num_splits
        head, tile_pid = pid % num_kv_heads, pid // num_kv_heads
        seq = max(s for s in range(len(q_lens)) if cu[s] // block_q + s <= tile_pid)
        tile = tile_pid - (cu[seq] // block_q + seq)
        order.append((seq, tile, head, split) if tile * block_q < q_lens[seq] else None)
    return order


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 70), min_size=1, max_size=12), st.sampled_from([1, 2, 4, 16, 32]),
       st.integers(1, 3), st.integers(1, 4))
def test_grid_covers_each_tile_head_and_split_exactly_once(q_lens, block_q, heads, splits):
    seen = [p for p in kernel_program_map(q_lens, block_q, heads, splits) if p is not None]
    expected = [(s, t, h, k) for s, n in enumerate(q_lens) for t in range(launch.cdiv(n, block_q))
                for h in range(heads) for k in range(splits)]
    assert sorted(seen) == expected


def test_causal_prefill_starts_with_its_longest_tiles():
    """A 2,048-token prefill without context (128-row tiles, 8 kv heads): the first programs the GPU
    dispatches take the last query tiles, which see the most keys; the last ones take tile 0."""
    order = [p for p in kernel_program_map([2048], 32, 8, 1) if p is not None]
    tiles = [tile for _, tile, _, _ in order]
    assert tiles[:8] == [63] * 8 and tiles[-8:] == [0] * 8
    assert tiles == sorted(tiles, reverse=True)


def test_device_limits_on_cpu_are_an_h100s():
    assert launch.device_limits(torch.device("cpu")) == launch.H100_LIMITS
    assert launch.sm_count(torch.device("cpu")) == 132


@pytest.mark.parametrize("unit", [16 * 64, 16 * 80, 32 * 128, 128 * 128, 128 * 256])
def test_copy_tile_covers_a_unit(unit):
    tile = launch.copy_tile(unit)
    assert tile.chunk * tile.num_chunks >= unit > tile.chunk * (tile.num_chunks - 1)
    assert tile.units_per_program * tile.chunk <= 8192


def test_split_count_from_real_context_lengths_not_table_width():
    """Two decodes of 100 and 200 tokens in a 1,000-page-wide table: with seq_lens on the host the plan
    splits nothing (one split needs 512 keys); from the width alone (a CUDA seq_lens is never read on the
    host) it would split, and then the kernel floors each sequence's splits by its real length."""
    from shadowprefill.triton_kernels import attention

    q = torch.empty(2, 4, 64)
    key_cache = torch.empty(1000, 16, 2, 64)
    table = torch.zeros(2, 1000, dtype=torch.int32)
    (wide,) = attention.plan(q, key_cache, table)
    (real,) = attention.plan(q, key_cache, table, seq_lens=torch.tensor([100, 200], dtype=torch.int32))
    assert wide.num_splits > 1 and real.num_splits == 1
