"""Launch-parameter table and plans of shadowprefill.triton_kernels.launch (pure Python, no kernels)."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from shadowprefill.triton_kernels import launch

H200_SMS = 132


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 8, 16, 32])
@pytest.mark.parametrize("decode", [True, False])
def test_attention_tile_shapes_are_valid_dot_tiles(head_dim, group, decode):
    tile = launch.attention_tile(head_dim, group, torch.bfloat16, decode)
    assert tile.block_m >= 16 and tile.block_m == tile.block_q * tile.group_padded
    assert tile.group_padded >= group and tile.group_padded & (tile.group_padded - 1) == 0
    assert tile.head_dim_padded >= head_dim and tile.head_dim_padded & (tile.head_dim_padded - 1) == 0
    assert tile.block_n >= 16 and tile.block_q >= 1
    if decode:
        assert tile.block_m == max(16, tile.group_padded)  # decode tiles stay small: the kernel reads K/V


def test_float32_tiles_are_smaller():
    assert launch.attention_tile(128, 4, torch.float32, False).block_n < \
        launch.attention_tile(128, 4, torch.bfloat16, False).block_n


def test_splits_fill_the_gpu_only_when_needed():
    # batch 1 x 8 kv heads x 128K context: few programs, long context -> many splits
    assert launch.num_kv_splits(8, 131072, H200_SMS) == 32
    # batch 64 x 8 kv heads fills 132 SMs already
    assert launch.num_kv_splits(512, 8192, H200_SMS) == 1
    # short context: not worth splitting below MIN_TOKENS_PER_SPLIT keys per split
    assert launch.num_kv_splits(8, 600, H200_SMS) == 1
    assert launch.num_kv_splits(8, 1024, H200_SMS) == 2
    # depends on the SM count, not on a fixed threshold
    assert launch.num_kv_splits(64, 65536, 16) == 1 and launch.num_kv_splits(64, 65536, H200_SMS) == 4


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4096), st.integers(1, 1 << 20), st.integers(1, 256))
def test_splits_are_bounded_powers_of_two(programs, context, sms):
    splits = launch.num_kv_splits(programs, context, sms)
    assert 1 <= splits <= launch.MAX_SPLITS and splits & (splits - 1) == 0
    assert splits == 1 or context // splits >= launch.MIN_TOKENS_PER_SPLIT


def test_plans():
    tile = launch.attention_tile(128, 4, torch.bfloat16, decode=True)
    # all decodes: one decode-tile launch taking every sequence, split when the batch is small
    (plan,) = launch.plan_attention(1, 1, 128, 4, 8, 131072, torch.bfloat16, H200_SMS)
    assert plan.tile == tile and plan.num_splits == 32 and plan.q_len_max == launch.Q_LEN_UNBOUNDED
    (plan,) = launch.plan_attention(256, 256, 128, 4, 8, 8192, torch.bfloat16, H200_SMS)
    assert plan.tile == tile and plan.num_splits == 1
    # one prefill chunk
    (plan,) = launch.plan_attention(2048, 1, 128, 4, 8, 32768, torch.bfloat16, H200_SMS)
    assert plan.tile.block_m == 128 and plan.num_splits == 1
    # a mix: decode tile for q_len <= its block_q, prefill tile for the rest, no gap, no overlap
    decode, prefill = launch.plan_attention(2112, 65, 128, 4, 8, 16384, torch.bfloat16, H200_SMS)
    assert (decode.q_len_min, decode.q_len_max) == (0, tile.block_q)
    assert (prefill.q_len_min, prefill.q_len_max) == (tile.block_q + 1, launch.Q_LEN_UNBOUNDED)
    # forcing applies to any batch and needs no env
    with launch.forced_splits(3):
        (plan,) = launch.plan_attention(2112, 65, 128, 4, 8, 16384, torch.bfloat16, H200_SMS)
        assert plan.num_splits == 3 and plan.q_len_max == launch.Q_LEN_UNBOUNDED
    assert launch.forced_num_splits() is None
    with pytest.raises(ValueError, match="num_splits"):
        with launch.forced_splits(0):
            pass


def test_forced_splits_from_environment(monkeypatch):
    monkeypatch.setenv("SHADOWPREFILL_KV_SPLITS", "4")
    assert launch.forced_num_splits() == 4
    monkeypatch.setenv("SHADOWPREFILL_KV_SPLITS", "1000")
    with pytest.raises(ValueError, match="SHADOWPREFILL_KV_SPLITS"):
        launch.forced_num_splits()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 70), min_size=1, max_size=12), st.sampled_from([1, 2, 4, 16, 32]))
def test_query_tile_grid_covers_each_tile_exactly_once(q_lens, block_q):
    """The kernel's program -> (sequence, tile) map (binary search over cu_seqlens_q), replayed in
    Python: every tile of every sequence gets exactly one program of the cdiv(T, block_q) + S grid."""
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    seen = []
    for pid in range(launch.num_query_tiles(cu[-1], len(q_lens), block_q)):
        seq = max(s for s in range(len(q_lens)) if cu[s] // block_q + s <= pid)
        tile = pid - (cu[seq] // block_q + seq)
        if tile * block_q < q_lens[seq]:
            seen.append((seq, tile))
    expected = [(s, t) for s, n in enumerate(q_lens) for t in range(launch.cdiv(n, block_q))]
    assert sorted(seen) == expected


@pytest.mark.parametrize("unit", [16 * 64, 16 * 80, 32 * 128, 128 * 128, 128 * 256])
def test_copy_tile_covers_a_unit(unit):
    tile = launch.copy_tile(unit)
    assert tile.chunk * tile.num_chunks >= unit > tile.chunk * (tile.num_chunks - 1)
    assert tile.units_per_program * tile.chunk <= 8192


def test_sm_count_on_cpu_is_the_pretend_value():
    assert launch.sm_count(torch.device("cpu")) == launch.CPU_SM_COUNT
