"""Gateway transfer path through the project's pack/unpack ops: wire bytes = kernel bytes, round trips checked
against plain torch indexing (bit-exact) and an fp8 e4m3 error bound computed here in float64."""
import pytest
import torch

from shadowprefill.gateway import transfer
from shadowprefill.gateway.registry import CacheLayout
from shadowprefill.gateway.sites import Link

L, H, BS, D = 3, 2, 4, 8


def _cache(num_blocks, dtype, fill=None, device="cpu"):
    shape = (num_blocks, L, 2, H, BS, D)
    if fill is not None:
        return torch.full(shape, fill, dtype=dtype, device=device)
    x = torch.randn(shape, dtype=torch.float32) * torch.rand(num_blocks, L, 2, H, 1, 1) * 8
    return x.to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layers", [None, (1, 3)])
def test_raw_round_trip_is_bit_exact(dtype, layers, backend, device):
    src = _cache(12, dtype, device=device)
    dst = _cache(9, dtype, fill=float("nan"), device=device)  # poisoned: every written element is overwritten
    src_ids, dst_ids = [7, 0, 11, 3, 4], [2, 8, 0, 5, 6]
    rep = transfer.send_blocks(src, src_ids, dst, dst_ids, layers=layers, link=Link(1e9, rtt_s=0.01))
    lo, hi = (0, L) if layers is None else layers
    src, dst = src.cpu(), dst.cpu()
    want = src[src_ids][:, lo:hi]
    got = dst[dst_ids][:, lo:hi]
    assert torch.equal(got.view(torch.uint8) if dtype != torch.float32 else got.view(torch.int32),
                       want.view(torch.uint8) if dtype != torch.float32 else want.view(torch.int32))
    untouched = torch.ones(9, dtype=torch.bool)
    untouched[dst_ids] = False
    assert torch.isnan(dst[untouched].float()).all()  # other pages untouched
    if layers is not None:
        assert torch.isnan(dst[dst_ids][:, :lo].float()).all() and torch.isnan(dst[dst_ids][:, hi:].float()).all()
    n_bytes = len(src_ids) * (hi - lo) * 2 * H * BS * D * src.element_size()
    assert rep.payload_bytes == n_bytes == transfer.packed_nbytes(len(src_ids), hi - lo, H, D, BS, src.element_size())
    assert rep.wire_bytes > rep.payload_bytes and rep.wire_bytes - rep.payload_bytes < 512  # small header only
    assert rep.est_time_s == pytest.approx(rep.wire_bytes / 1e9 + 0.01)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_round_trip_within_e4m3_error(dtype, backend, device):
    src = _cache(10, dtype, device=device)
    src[3, 1, 0, 1] = 0.0  # an all-zero head tile
    dst = _cache(10, dtype, fill=float("nan"), device=device)
    ids_src, ids_dst = [3, 9, 1, 4], [0, 1, 2, 3]
    rep = transfer.send_blocks(src, ids_src, dst, ids_dst, quant="fp8")
    x = src.cpu()[ids_src].double()
    y = dst.cpu()[ids_dst].double()
    assert torch.isfinite(y).all()
    amax = x.abs().amax(dim=(-2, -1), keepdim=True)  # per (page, layer, K/V, head) tile
    # e4m3: 3 mantissa bits -> relative rounding error <= 2^-4; subnormal spacing 2^-9 * scale, scale = amax/448;
    # a bf16/fp16 destination adds its own rounding (2^-8 relative).
    out_eps = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8}[dtype]
    bound = x.abs() * (2.0 ** -4 + out_eps) * (1 + 1e-6) + amax / 448 * 2.0 ** -10 + 1e-30
    assert ((y - x).abs() <= bound).all(), float(((y - x).abs() - bound).max())
    assert torch.equal(y[0, 1, 0, 1], torch.zeros_like(y[0, 1, 0, 1]))
    assert (y - x).abs().max() > 0  # it really was quantised
    want = transfer.packed_nbytes(4, L, H, D, BS, src.element_size(), quant="fp8")
    assert rep.payload_bytes == want == 4 * L * 2 * H * (BS * D + 4)
    lay = CacheLayout(BS, L, H, D, dtype="bfloat16", compression="fp8")
    assert lay.bytes_per_token * BS * 4 == want  # the registry / control plane cost the same bytes


def test_wire_format_round_trip_and_errors():
    src = _cache(4, torch.float16)
    p = transfer.pack_for_transfer(src, [1, 2], quant="fp8")
    wire = transfer.encode(p)
    q = transfer.decode(wire)
    assert q.quant == "fp8" and q.num_blocks == 2 and q.layers is None
    assert torch.equal(q.buf.view(torch.uint8), p.buf.view(torch.uint8)) and torch.equal(q.scales, p.scales)
    with pytest.raises(ValueError, match="magic"):
        transfer.decode(b"nope" + wire)
    with pytest.raises(ValueError, match="trailing"):
        transfer.decode(wire + b"\0")
    with pytest.raises(ValueError, match="quant"):
        transfer.pack_for_transfer(src, [1], quant="int4")
    with pytest.raises(ValueError, match="block_ids"):
        transfer.unpack_from_transfer(q, src, [0])
    assert transfer.choose_codec(0.9, 0.9) is None and transfer.choose_codec(0.9, 0.8) == "fp8"
