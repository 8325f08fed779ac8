"""Every bad input raises ValueError/TypeError naming the argument, before any kernel runs.

Structure errors (type, shape, dtype, device, contiguity) always; value errors (ids, slots, offsets) on CPU
tensors always, on CUDA tensors with SHADOWPREFILL_DEBUG=1. The value cases run on both backends: the
check has to fire before the Triton kernel would be launched.
"""
import pytest
import torch

from shadowprefill import ops
from shadowprefill.ops import _backend

F32, F16, I32, I64 = torch.float32, torch.float16, torch.int32, torch.int64


def attention_args():
    pool = torch.randn(8, 2, 2, 2, 16, 64)
    return dict(q=torch.randn(5, 4, 64), kv_cache=pool, layer=1,
                block_table=torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=I32),
                cu_seqlens_q=torch.tensor([0, 1, 5], dtype=I32), seq_lens=torch.tensor([10, 20], dtype=I32),
                scale=0.125)


def with_(base, **changes):
    args = dict(base)
    args.update(changes)
    return args


A = attention_args()
ATTENTION_STRUCTURE = [
    (with_(A, q=A["q"].numpy()), TypeError, "q"),
    (with_(A, q=A["q"].to(I32)), TypeError, "q"),
    (with_(A, q=A["q"][0]), ValueError, "q"),
    (with_(A, q=torch.randn(5, 4, 32)), ValueError, "q: head_dim"),
    (with_(A, q=torch.randn(5, 3, 64)), ValueError, "q: 3 query heads"),
    (with_(A, kv_cache=A["kv_cache"].half()), TypeError, "kv_cache"),
    (with_(A, kv_cache=A["kv_cache"][0]), ValueError, "kv_cache"),
    (with_(A, kv_cache=torch.randn(8, 2, 3, 2, 16, 64)), ValueError, "kv_cache: dim 2"),
    (with_(A, kv_cache=A["kv_cache"].transpose(4, 5).contiguous().transpose(4, 5)), ValueError, "kv_cache"),
    (with_(A, kv_cache=torch.randn(8, 2, 2, 2, 16, 64, device="meta")), ValueError, "kv_cache"),
    (with_(A, layer=2), ValueError, "layer"),
    (with_(A, layer=-1), ValueError, "layer"),
    (with_(A, layer=1.0), TypeError, "layer"),
    (with_(A, block_table=A["block_table"].long()), TypeError, "block_table"),
    (with_(A, block_table=A["block_table"][0]), ValueError, "block_table"),
    (with_(A, cu_seqlens_q=torch.tensor([0, 5], dtype=I32)), ValueError, "cu_seqlens_q"),
    (with_(A, cu_seqlens_q=A["cu_seqlens_q"].long()), TypeError, "cu_seqlens_q"),
    (with_(A, seq_lens=torch.tensor([10, 20, 30], dtype=I32)), ValueError, "seq_lens"),
    (with_(A, seq_lens=A["seq_lens"].float()), TypeError, "seq_lens"),
    (with_(A, scale=0.0), ValueError, "scale"),
    (with_(A, scale=float("nan")), ValueError, "scale"),
    (with_(A, scale="0.1"), TypeError, "scale"),
    (with_(A, out=torch.empty(5, 4, 32)), ValueError, "out"),
    (with_(A, out=torch.empty(5, 4, 64, dtype=F16)), TypeError, "out"),
    (with_(A, out=torch.empty(4, 64, 5).permute(2, 0, 1)), ValueError, "out"),
    (with_(A, out=[1, 2]), TypeError, "out"),
    (with_(A, sliding_window=-1), ValueError, "sliding_window"),
    (with_(A, sliding_window=2.5), TypeError, "sliding_window"),
    (with_(A, softcap=float("inf")), ValueError, "softcap"),
    (with_(A, softcap=-30.0), ValueError, "softcap"),
]
ATTENTION_VALUES = [
    (with_(A, cu_seqlens_q=torch.tensor([1, 1, 5], dtype=I32)), "cu_seqlens_q: must start at 0"),
    (with_(A, cu_seqlens_q=torch.tensor([0, 6, 5], dtype=I32)), "cu_seqlens_q: must be non-decreasing"),
    (with_(A, cu_seqlens_q=torch.tensor([0, 1, 4], dtype=I32)), "cu_seqlens_q: last entry 4"),
    (with_(A, seq_lens=torch.tensor([10, 3], dtype=I32)), "seq_lens: sequence 1"),
    (with_(A, seq_lens=torch.tensor([10, 49], dtype=I32)), "block_table: sequence 1 needs 4 blocks"),
    (with_(A, block_table=torch.tensor([[0, 1, 2], [3, 8, 5]], dtype=I32)), "block_table: id 8"),
    (with_(A, block_table=torch.tensor([[0, 1, 2], [3, -2, 5]], dtype=I32)), "block_table: id -2"),
]


@pytest.mark.parametrize("args, error, name", ATTENTION_STRUCTURE)
def test_paged_attention_structure(args, error, name):
    with pytest.raises(error, match=name):
        ops.paged_attention(**args)


def test_zero_window_and_softcap_mean_off():
    """sliding_window=0 and softcap=0.0 are the documented "off" values: the same result as None, and
    different from a real window / softcap on this batch (so the comparison can fail)."""
    off = ops.paged_attention(**A)
    zero = ops.paged_attention(**with_(A, sliding_window=0, softcap=0.0))
    torch.testing.assert_close(zero, off, rtol=0, atol=0)
    assert not torch.allclose(ops.paged_attention(**with_(A, sliding_window=3)), off)
    assert not torch.allclose(ops.paged_attention(**with_(A, softcap=0.5)), off)


@pytest.mark.parametrize("args, message", ATTENTION_VALUES)
def test_paged_attention_values(backend, args, message):
    with pytest.raises(ValueError, match=message):
        ops.paged_attention(**args)


def write_args():
    return dict(key=torch.randn(4, 2, 64), value=torch.randn(4, 2, 64), kv_cache=torch.randn(8, 2, 2, 2, 16, 64),
                layer=0, slot_mapping=torch.tensor([0, 17, -1, 127]))


W = write_args()
WRITE_STRUCTURE = [
    (with_(W, key=W["key"].half()), TypeError, "key"),
    (with_(W, key=torch.randn(4, 3, 64)), ValueError, "key"),
    (with_(W, value=torch.randn(3, 2, 64)), ValueError, "value"),
    (with_(W, value=None), TypeError, "value"),
    (with_(W, kv_cache=W["kv_cache"][:, :, :, :, :, :32].contiguous()), ValueError, "key"),
    (with_(W, kv_cache=W["kv_cache"][:, :, :, :, :, :32]), ValueError, "kv_cache"),
    (with_(W, layer=2), ValueError, "layer"),
    (with_(W, slot_mapping=W["slot_mapping"].int()), TypeError, "slot_mapping"),
    (with_(W, slot_mapping=torch.tensor([0, 1, 2])), ValueError, "slot_mapping"),
    (with_(W, slot_mapping=torch.tensor([0, 1, 2, 3], device="meta")), ValueError, "slot_mapping"),
]
WRITE_VALUES = [
    (with_(W, slot_mapping=torch.tensor([0, 17, -1, 128])), "slot_mapping: slot 128"),
    (with_(W, slot_mapping=torch.tensor([5, 17, 5, 1])), "slot_mapping: duplicate destination id 5"),
]


@pytest.mark.parametrize("args, error, name", WRITE_STRUCTURE)
def test_write_kv_structure(args, error, name):
    with pytest.raises(error, match=name):
        ops.write_kv(**args)


@pytest.mark.parametrize("args, message", WRITE_VALUES)
def test_write_kv_values(backend, args, message):
    with pytest.raises(ValueError, match=message):
        ops.write_kv(**args)


def copy_args():
    return dict(src=torch.randn(8, 2, 2, 2, 16, 64).half(), dst=torch.randn(6, 2, 2, 2, 16, 64).half(),
                src_block_ids=torch.tensor([0, 7, 3]), dst_block_ids=torch.tensor([5, 0, 1], dtype=I32))


C = copy_args()
COPY_STRUCTURE = [
    (with_(C, src=C["src"].float()), TypeError, "dst"),
    (with_(C, dst=torch.randn(6, 2, 2, 2, 32, 64).half()), ValueError, "dst: page shape"),
    (with_(C, src=C["src"][:, :, :, :, ::2]), ValueError, "src"),
    (with_(C, src_block_ids=C["src_block_ids"].float()), TypeError, "src_block_ids"),
    (with_(C, src_block_ids=C["src_block_ids"][None]), ValueError, "src_block_ids"),
    (with_(C, dst_block_ids=torch.tensor([1, 2])), ValueError, "dst_block_ids"),
    (with_(C, dst_block_ids=torch.tensor([1, 2, 3], device="meta")), ValueError, "dst_block_ids"),
    (with_(C, src=None), TypeError, "src"),
    (with_(C, layers=(1, 1)), ValueError, "layers"),
    (with_(C, layers=(0, 3)), ValueError, "layers"),
    (with_(C, layers=1), TypeError, "layers"),
]
COPY_VALUES = [
    (with_(C, src_block_ids=torch.tensor([0, 8, 3])), "src_block_ids: id 8"),
    (with_(C, dst_block_ids=torch.tensor([5, -1, 1])), "dst_block_ids: id -1"),
    (with_(C, dst_block_ids=torch.tensor([5, 1, 5])), "dst_block_ids: duplicate destination id 5"),
    (with_(C, dst=C["src"], dst_block_ids=torch.tensor([1, 2, 7])), "dst_block_ids: page 7 is also a source"),
]


@pytest.mark.parametrize("args, error, name", COPY_STRUCTURE)
def test_copy_blocks_structure(args, error, name):
    with pytest.raises(error, match=name):
        ops.copy_blocks(**args)


@pytest.mark.parametrize("args, message", COPY_VALUES)
def test_copy_blocks_values(backend, args, message):
    dst_before = args["dst"].clone()
    with pytest.raises(ValueError, match=message):
        ops.copy_blocks(**args)
    assert torch.equal(args["dst"], dst_before)


POOL = torch.randn(8, 4, 2, 2, 16, 64)
IDS = torch.tensor([1, 6])
PACK_ERRORS = [
    (dict(kv_cache=POOL[0], block_ids=IDS), ValueError, "kv_cache"),
    (dict(kv_cache=POOL.to(I32), block_ids=IDS), TypeError, "kv_cache"),
    (dict(kv_cache=POOL, block_ids=IDS.float()), TypeError, "block_ids"),
    (dict(kv_cache=POOL, block_ids=IDS, layers=(2, 1)), ValueError, "layers"),
    (dict(kv_cache=POOL, block_ids=IDS, layers=(0, 5)), ValueError, "layers"),
    (dict(kv_cache=POOL, block_ids=IDS, layers=2), TypeError, "layers"),
    (dict(kv_cache=POOL, block_ids=IDS, quant="int4"), ValueError, "quant"),
]


@pytest.mark.parametrize("kwargs, error, name", PACK_ERRORS)
def test_pack_blocks_structure(kwargs, error, name):
    with pytest.raises(error, match=name):
        ops.pack_blocks(**kwargs)


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_pack_blocks_values(backend, quant):
    with pytest.raises(ValueError, match="block_ids: id 8"):
        ops.pack_blocks(POOL, torch.tensor([1, 8]), quant=quant)


BUF = torch.randn(2, 4, 2, 2, 16, 64)
FP8_BUF = BUF.to(torch.float8_e4m3fn)
SCALES = torch.ones(2, 4, 2, 2)
UNPACK_ERRORS = [
    (dict(buf=BUF[:, :2]), ValueError, "buf: expected shape"),
    (dict(buf=BUF.half()), TypeError, "buf"),
    (dict(buf=BUF.transpose(4, 5).contiguous().transpose(4, 5)), ValueError, "buf: must be contiguous"),
    (dict(buf=BUF, scales=SCALES), ValueError, "scales: must be None"),
    (dict(buf=FP8_BUF, scales=None), ValueError, "scales: required"),
    (dict(buf=FP8_BUF, scales=SCALES[:, :2]), ValueError, "scales"),
    (dict(buf=FP8_BUF, scales=SCALES.half()), TypeError, "scales"),
    (dict(buf=BUF, block_ids=IDS[:1]), ValueError, "buf: expected shape"),
    (dict(buf=BUF, layers=(0, 2)), ValueError, "buf: expected shape"),
]


@pytest.mark.parametrize("kwargs, error, name", UNPACK_ERRORS)
def test_unpack_blocks_structure(kwargs, error, name):
    args = dict(buf=BUF, scales=None, kv_cache=POOL.clone(), block_ids=IDS)
    args.update(kwargs)
    with pytest.raises(error, match=name):
        ops.unpack_blocks(**args)


@pytest.mark.parametrize("ids, message", [([3, 8], "block_ids: id 8"), ([4, 4], "duplicate destination id 4")])
def test_unpack_blocks_values(backend, ids, message):
    pool = POOL.clone()
    with pytest.raises(ValueError, match=message):
        ops.unpack_blocks(FP8_BUF, SCALES, pool, torch.tensor(ids))
    assert torch.equal(pool, POOL)


def test_value_checks_on_cuda_only_in_debug_mode(monkeypatch):
    monkeypatch.delenv("SHADOWPREFILL_DEBUG", raising=False)
    assert _backend.value_checks_enabled(torch.device("cpu"))
    assert not _backend.value_checks_enabled(torch.device("cuda"))
    monkeypatch.setenv("SHADOWPREFILL_DEBUG", "1")
    assert _backend.value_checks_enabled(torch.device("cuda"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_value_checks_in_debug_mode(monkeypatch):
    monkeypatch.setenv("SHADOWPREFILL_DEBUG", "1")
    args = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in ATTENTION_VALUES[-2][0].items()}
    with pytest.raises(ValueError, match="block_table: id 8"):
        ops.paged_attention(**args)
    with pytest.raises(ValueError, match="slot_mapping: slot 128"):
        ops.write_kv(**{k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in WRITE_VALUES[0][0].items()})
