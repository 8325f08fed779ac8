"""Each op passes torch.library.opcheck and traces under torch.compile(fullgraph=True)."""
import pytest
import torch

from shadowprefill import ops

from shadowprefill.ops.testing import nan_pool, random_batch


def small_inputs(device):
    pool = nan_pool(16, 2, 2, 16, 64, torch.float32, device)
    batch = random_batch([(9, 1), (3, 6)], pool, layer=1, num_q_heads=4)
    pool.copy_(torch.where(pool.isnan(), torch.randn_like(pool), pool))  # opcheck compares with NaN != NaN
    key = torch.randn(3, 2, 64, device=device)
    slots = torch.tensor([40, -1, 200], device=device)
    return pool, batch, key, slots


def test_opcheck(backend, device):
    pool, batch, key, slots = small_inputs(device)
    ids = torch.tensor([3, 0, 9])
    sp = torch.ops.shadowprefill
    out = torch.empty_like(batch["q"])
    attention = (batch["q"], pool, 1, batch["block_table"], batch["cu_seqlens_q"], batch["seq_lens"], 0.125, out)
    torch.library.opcheck(sp.paged_attention.default, attention + (0, 0.0))
    torch.library.opcheck(sp.paged_attention.default, attention + (4, 30.0))
    torch.library.opcheck(sp.write_kv.default, (key, key.clone(), pool, 0, slots))
    torch.library.opcheck(sp.copy_blocks.default, (pool, torch.zeros_like(pool), ids, ids.flip(0), 0, pool.shape[1]))
    torch.library.opcheck(sp.copy_blocks.default, (pool, torch.zeros_like(pool), ids, ids.flip(0), 1, 2))
    for quant in (None, "fp8"):
        buf, scales = sp.pack_blocks(pool, ids, 0, 2, quant)
        torch.library.opcheck(sp.pack_blocks.default, (pool, ids, 0, 2, quant))
        unpack = (buf, scales if quant else None, torch.zeros_like(pool), ids, 0, 2)
        if quant is None:
            torch.library.opcheck(sp.unpack_blocks.default, unpack)
            continue
        # opcheck's test_schema compares an fp8 input before/after with a multiply torch lacks for fp8
        # on the CPU; check the other utilities, and by hand that only kv_cache changes
        torch.library.opcheck(sp.unpack_blocks.default, unpack,
                              test_utils=("test_autograd_registration", "test_faketensor",
                                          "test_aot_dispatch_dynamic"))
        buf_before, scales_before = buf.view(torch.int8).clone(), scales.clone()
        sp.unpack_blocks(*unpack)
        assert torch.equal(buf.view(torch.int8), buf_before) and torch.equal(scales, scales_before)


def serving_step(q, key, pool, block_table, cu_seqlens_q, seq_lens, slots, host, ids):
    """What one engine iteration does with the ops: write, attend, spill, push."""
    ops.write_kv(key, key * 2, pool, 1, slots)
    out = ops.paged_attention(q, pool, 1, block_table, cu_seqlens_q, seq_lens, 0.125, sliding_window=8,
                              softcap=20.0)
    ops.copy_blocks(pool, host, ids, ids)
    buf, scales = ops.pack_blocks(pool, ids, layers=(1, 2), quant="fp8")
    ops.unpack_blocks(buf, scales, host, ids.flip(0), layers=(1, 2))
    raw, none = ops.pack_blocks(pool, ids)
    return out * 2, raw, none is None


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph(dynamic):
    pool, batch, key, slots = small_inputs("cpu")
    pool_c, host, host_c = pool.clone(), torch.zeros_like(pool), torch.zeros_like(pool)
    ids = torch.tensor([3, 0, 9])
    args = (batch["q"], key, pool, batch["block_table"], batch["cu_seqlens_q"], batch["seq_lens"], slots)
    eager = serving_step(*args, host, ids)
    compiled = torch.compile(serving_step, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    result = compiled(batch["q"], key, pool_c, *args[3:], host_c, ids)
    torch.testing.assert_close(result[0], eager[0], equal_nan=True)
    assert torch.equal(result[1], eager[1]) and result[2] is True
    assert torch.equal(pool_c.nan_to_num(), pool.nan_to_num()) and torch.equal(host_c.nan_to_num(),
                                                                                host.nan_to_num())
