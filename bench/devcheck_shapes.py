"""Timed sections of bench/device_check.py: ceilings, prefill, decode, mixed batch, pack/unpack, copy_blocks.

Every section takes (table, device, ceilings, dry, max_kv_gib, deadline) and adds rows to the table.
GPU shapes follow issue 3 (bf16, head_dim 128, Hq 32 / Hkv 8, block 16); --dry-run shrinks them.
"""
import math
import time

import torch

import devcheck_timing as timing
from shadowprefill import triton_kernels as tk
from shadowprefill.triton_kernels import launch

GIB = 2 ** 30


class Config:
    def __init__(self, dry: bool):
        self.dtype = torch.float32 if dry else torch.bfloat16
        self.num_q_heads, self.num_kv_heads = (4, 2) if dry else (32, 8)
        self.head_dim = 64 if dry else 128
        self.block_size = 16
        self.elem = torch.tensor([], dtype=self.dtype).element_size()
        self.token_kv_bytes = 2 * self.num_kv_heads * self.head_dim * self.elem  # K + V of one token, one layer
        self.scale = 1.0 / math.sqrt(self.head_dim)

    def pool(self, num_pages: int, device) -> torch.Tensor:
        shape = (num_pages, 1, 2, self.num_kv_heads, self.block_size, self.head_dim)
        return torch.randn(shape, device=device, dtype=self.dtype)


def ceilings(table, device, dry) -> dict:
    copy = timing.copy_ceiling(device, (16 << 20) if dry else 2 * GIB)
    table.add("ceiling", "D2D copy (read+write)", copy / 1e9, "GB/s")
    n, dtype = (256, torch.float32) if dry else (8192, torch.bfloat16)
    mm = timing.matmul_ceiling(device, n, dtype)
    table.add("ceiling", f"matmul {n}^3 {str(dtype)[6:]}", mm / 1e12, "TFLOP/s")
    result = {"copy": copy, "matmul": mm}
    for direction, rate in timing.host_copy_rates(device, 512 << 20).items():
        table.add("ceiling", f"contiguous pinned {direction}", rate / 1e9, "GB/s")
        result[direction] = rate
    return result


def paged_problems(pool, seqs, copies, cfg, device):
    """`copies` independent batches for seqs = [(context, q_len)] over disjoint random pages of `pool`."""
    bs = cfg.block_size
    lens = [c + n for c, n in seqs]
    pages = [-(-n // bs) for n in lens]
    needed = sum(pages)
    if copies * needed > pool.shape[0]:
        raise ValueError(f"pool of {pool.shape[0]} pages < {copies} x {needed}")
    perm = torch.randperm(pool.shape[0], device=device)[:copies * needed].to(torch.int32)
    q_lens = [n for _, n in seqs]
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32).to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    problems = []
    for c in range(copies):
        ids = perm[c * needed:(c + 1) * needed]
        if len(set(pages)) == 1:
            table = ids.view(len(seqs), pages[0]).contiguous()
        else:
            table = torch.zeros((len(seqs), max(pages)), dtype=torch.int32, device=device)
            offset = 0
            for s, n in enumerate(pages):
                table[s, :n] = ids[offset:offset + n]
                offset += n
        q = torch.randn((sum(q_lens), cfg.num_q_heads, cfg.head_dim), device=device, dtype=cfg.dtype)
        problems.append(dict(q=q, block_table=table, cu=cu, lens=seq_lens, out=torch.empty_like(q)))
    return problems


def attention_calls(pool, problems, cfg):
    return [lambda p=p: tk.paged_attention(p["q"], pool, 0, p["block_table"], p["cu"], p["lens"], cfg.scale,
                                           p["out"]) for p in problems]


def plan_note(seqs, cfg, device) -> str:
    tokens = sum(n for _, n in seqs)
    max_context = max(c + n for c, n in seqs)
    plans = launch.plan_attention(tokens, len(seqs), cfg.head_dim, cfg.num_q_heads // cfg.num_kv_heads,
                                  cfg.num_kv_heads, -(-max_context // cfg.block_size) * cfg.block_size,
                                  cfg.dtype, launch.sm_count(device))
    return ", ".join(f"{p.tile.block_m}x{p.tile.block_n} w{p.tile.num_warps} s{p.tile.num_stages}"
                     + (f" split{p.num_splits}" if p.num_splits > 1 else "") for p in plans)


def problem_bytes(seqs, cfg) -> int:
    tokens = sum(n for _, n in seqs)
    return sum(c + n for c, n in seqs) * cfg.token_kv_bytes + 2 * tokens * cfg.num_q_heads * cfg.head_dim * cfg.elem


def prefill(table, device, ceil, dry, max_kv_gib, deadline):
    cfg = Config(dry)
    chunk, contexts = (32, (0, 64)) if dry else (2048, (0, 8192, 32768, 65536))
    l2 = timing.l2_bytes(device)
    for context in contexts:
        if time.time() > deadline:
            table.add("prefill", f"chunk {chunk} on ctx {context}", None, "", note="skipped: time budget")
            continue
        seqs = [(context, chunk)]
        copies = timing.rotation_count(problem_bytes(seqs, cfg), l2, cap=16)
        pool = cfg.pool(copies * -(-(context + chunk) // cfg.block_size), device)
        problems = paged_problems(pool, seqs, copies, cfg, device)
        seconds = timing.median_seconds(attention_calls(pool, problems, cfg), device)
        flops = 4 * cfg.num_q_heads * cfg.head_dim * sum(context + i + 1 for i in range(chunk))  # causal only
        rate = flops / seconds
        try:
            peer_seconds, peer_err = sdpa_peer(pool, problems, cfg, device)
            peer = f"sdpa flash {flops / peer_seconds / 1e12:.3g} TFLOP/s"
            vs_peer, vs_note = peer_seconds / seconds, f"vs peer out rel err {peer_err:.1e}"
        except Exception as e:  # noqa: BLE001 - the peer failing must not hide our number
            peer, vs_peer, vs_note = "sdpa flash failed", None, f"{type(e).__name__}: {e}"[:120]
        table.add("prefill", f"chunk {chunk} on ctx {context}", rate / 1e12, "TFLOP/s", rate / ceil["matmul"],
                  peer, vs_peer, f"{seconds * 1e3:.3f} ms; {vs_note}; {plan_note(seqs, cfg, device)}")
        del pool, problems


def sdpa_peer(pool, problems, cfg, device):
    """Seconds of torch's flash attention on the same problems (dense K/V expanded to Hq heads), and the
    relative difference of its output from ours on the first problem."""
    group = cfg.num_q_heads // cfg.num_kv_heads
    dense = []
    for p in problems:
        length = int(p["lens"][0])
        pos = torch.arange(length, device=device)
        pages = p["block_table"][0].long()[pos // cfg.block_size]
        kv = pool[pages, 0, :, :, pos % cfg.block_size]                  # [L, 2, Hkv, D]
        k = kv[:, 0].repeat_interleave(group, dim=1).transpose(0, 1)[None].contiguous()  # [1, Hq, L, D]
        v = kv[:, 1].repeat_interleave(group, dim=1).transpose(0, 1)[None].contiguous()
        dense.append((p["q"].transpose(0, 1)[None].contiguous(), k, v))

    def call(q, k, v):
        if device.type == "cuda":  # is_causal on seq_q < seq_k: flash's bottom-right causal mask
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False,
                                                                       scale=cfg.scale)[0]
        lq, lk = q.shape[2], k.shape[2]
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=cfg.scale)

    seconds = timing.median_seconds([lambda d=d: call(*d) for d in dense], device)
    ours = problems[0]["out"].double()
    theirs = call(*dense[0])[0].transpose(0, 1).double()
    return seconds, float((ours - theirs).norm() / theirs.norm())


def decode(table, device, ceil, dry, max_kv_gib, deadline):
    cfg = Config(dry)
    batches, contexts = ((1, 2), (64,)) if dry else ((1, 8, 64, 256), (1024, 8192, 32768, 131072))
    l2 = timing.l2_bytes(device)
    shapes, skipped = [], []
    for batch in batches:
        for context in contexts:
            kv = batch * context * cfg.token_kv_bytes
            (shapes if kv <= max_kv_gib * GIB else skipped).append((batch, context, kv))
    pages_per_shape = {}
    for batch, context, kv in shapes:
        copies = timing.rotation_count(kv, l2)
        pages_per_shape[(batch, context)] = (copies, copies * batch * -(-context // cfg.block_size))
    pool = cfg.pool(max(p for _, p in pages_per_shape.values()), device)
    for batch, context, kv in shapes:
        name = f"batch {batch} x ctx {context}"
        if time.time() > deadline:
            table.add("decode", name, None, "", note="skipped: time budget")
            continue
        copies = pages_per_shape[(batch, context)][0]
        seqs = [(context - 1, 1)] * batch
        problems = paged_problems(pool, seqs, copies, cfg, device)
        seconds = timing.median_seconds(attention_calls(pool, problems, cfg), device)
        rate = kv / seconds
        table.add("decode", name, rate / 1e9, "GB/s KV", rate / ceil["copy"],
                  note=f"{seconds * 1e6:.1f} us; {plan_note(seqs, cfg, device)}")
        del problems
    for batch, context, kv in skipped:
        table.add("decode", f"batch {batch} x ctx {context}", None, "",
                  note=f"skipped: KV {kv / GIB:.0f} GiB > --max-kv-gib {max_kv_gib:g}")
    del pool


def mixed(table, device, ceil, dry, max_kv_gib, deadline):
    cfg = Config(dry)
    decodes = [(63, 1)] * 4 if dry else [(8191, 1)] * 64
    chunk = [(64, 32)] if dry else [(16384, 2048)]
    variants = {"mixed": decodes + chunk, "decodes": decodes, "chunk": chunk}
    l2 = timing.l2_bytes(device)
    copies = timing.rotation_count(problem_bytes(variants["mixed"], cfg), l2, cap=16)
    pages = sum(-(-(c + n) // cfg.block_size) for c, n in variants["mixed"])
    pool = cfg.pool(copies * pages, device)
    seconds = {}
    for name, seqs in variants.items():
        problems = paged_problems(pool, seqs, copies, cfg, device)
        seconds[name] = timing.median_seconds(attention_calls(pool, problems, cfg), device)
    apart = seconds["decodes"] + seconds["chunk"]
    table.add("mixed", f"{len(decodes)} decodes + chunk {chunk[0][1]} at {chunk[0][0]}", seconds["mixed"] * 1e3,
              "ms", None, f"separately {apart * 1e3:.3f} ms", apart / seconds["mixed"],
              f"decodes {seconds['decodes'] * 1e3:.3f} ms + chunk {seconds['chunk'] * 1e3:.3f} ms; "
              f"{plan_note(variants['mixed'], cfg, device)}")


def llama_pages(dry, device, num_pages):
    """A Llama-3-8B page (32 layers, 8 kv heads, 16 x 128, bf16 = 2 MiB); tiny in a dry run."""
    shape = (num_pages, 2, 2, 2, 16, 64) if dry else (num_pages, 32, 2, 8, 16, 128)
    return torch.randn(shape, dtype=torch.float32 if dry else torch.bfloat16, device=device)


def host_copy(cache, pin):
    """A host cache like `cache` (pinned when a GPU is present), filled from it."""
    host = torch.empty(cache.shape, dtype=cache.dtype, pin_memory=pin)
    host.copy_(cache)
    return host


def pack_unpack(table, device, ceil, dry, max_kv_gib, deadline):
    num_pages, moved = (64, 16) if dry else (1024, 256)
    cache = llama_pages(dry, device, num_pages)
    ids = torch.randperm(num_pages, device=device)[:moved]
    nbytes = moved * cache[0].numel() * cache.element_size()
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    contiguous = timing.median_seconds([lambda: dst.copy_(src)], device)
    layers = cache.shape[1]
    for quant in (None, "fp8"):
        buf, scales = tk.pack_blocks(cache, ids, 0, layers, quant)
        packed = buf.numel() * buf.element_size() + scales.numel() * 4
        calls = {"pack": lambda: tk.pack_blocks(cache, ids, 0, layers, quant),
                 "unpack": lambda: tk.unpack_blocks(buf, scales, cache, ids, 0, layers)}
        for direction, fn in calls.items():
            seconds = timing.median_seconds([fn], device)
            moved_bytes = nbytes + packed  # read one side, write the other
            table.add("pack/unpack", f"{direction} {quant or 'bf16' if not dry else quant or 'fp32'} "
                      f"{moved} pages", moved_bytes / seconds / 1e9, "GB/s r+w", moved_bytes / seconds / ceil["copy"],
                      f"contiguous copy {2 * nbytes / contiguous / 1e9:.3g} GB/s r+w", contiguous / seconds,
                      f"{seconds * 1e3:.3f} ms for {nbytes / 2**20:.3g} MiB of cache")


def copy_blocks(table, device, ceil, dry, max_kv_gib, deadline):
    from shadowprefill import ops

    num_pages, moved = (64, 16) if dry else (1024, 256)
    gpu = llama_pages(dry, device, num_pages)
    host = host_copy(llama_pages(dry, device, num_pages), pin=device.type == "cuda")
    nbytes = moved * gpu[0].numel() * gpu.element_size()
    for ids_kind in ("random", "consecutive"):
        if ids_kind == "random":
            src_ids, dst_ids = torch.randperm(num_pages)[:moved], torch.randperm(num_pages)[:moved]
        else:
            src_ids, dst_ids = torch.arange(moved), torch.arange(moved) + (num_pages - moved)
        for direction, (src, dst) in (("d2h", (gpu, host)), ("h2d", (host, gpu))):
            seconds = timing.median_seconds([lambda: ops.copy_blocks(src, dst, src_ids, dst_ids)], device,
                                            graph=False)
            rate = nbytes / seconds
            peer = ceil.get(direction)
            table.add("copy_blocks", f"{direction} {ids_kind} {moved} pages", rate / 1e9, "GB/s", None,
                      f"contiguous pinned {peer / 1e9:.1f} GB/s" if peer else "", rate / peer if peer else None,
                      f"{seconds * 1e3:.3f} ms for {nbytes / 2**20:.3g} MiB")
