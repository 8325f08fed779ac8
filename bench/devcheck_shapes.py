"""Attention sections of bench/device_check.py: ceilings, prefill (with torch SDPA peers), short chunks on
long contexts, decode, the mixed batch and the tile sweep.

Every section takes (table, device, ceilings, dry, deadline, results) and adds rows to the table and
numbers to `results` (read by the verdicts). GPU shapes: bf16, head_dim 128, Hq 32 / Hkv 8, block 16;
--dry-run shrinks them (fp32, Hq 4 / Hkv 2, head_dim 64) and runs the kernels under the interpreter.
"""
import math
import time

import torch

import devcheck_timing as timing
from shadowprefill import triton_kernels as tk
from shadowprefill.ops.testing import random_batch
from shadowprefill.triton_kernels import launch

GIB = 2 ** 30
MAX_KV_GIB = 40.0


class Config:
    def __init__(self, dry: bool):
        self.dtype = torch.float32 if dry else torch.bfloat16
        self.num_q_heads, self.num_kv_heads = (4, 2) if dry else (32, 8)
        self.head_dim = 64 if dry else 128
        self.block_size = 16
        self.elem = torch.tensor([], dtype=self.dtype).element_size()
        self.token_kv_bytes = 2 * self.num_kv_heads * self.head_dim * self.elem  # K + V of one token, one layer
        self.scale = 1.0 / math.sqrt(self.head_dim)


def ceilings(table, device, dry) -> dict:
    copy = timing.copy_ceiling(device, (16 << 20) if dry else 2 * GIB)
    table.add("ceiling", "D2D copy (read+write)", copy / 1e9, "GB/s")
    n, dtype = (256, torch.float32) if dry else (8192, torch.bfloat16)
    mm = timing.matmul_ceiling(device, n, dtype)
    table.add("ceiling", f"matmul {n}^3 {str(dtype)[6:]}", mm / 1e12, "TFLOP/s")
    result = {"copy": copy, "matmul": mm}
    for direction, rate in timing.host_copy_rates(device, 512 << 20).items():
        table.add("ceiling", f"contiguous pinned {direction} 512 MiB", rate / 1e9, "GB/s")
        result[direction] = rate
    return result


def pool_for(seqs, copies, cfg, device) -> torch.Tensor:
    """An unwritten pool with room for `copies` batches of seqs (their pages plus one NaN page each)."""
    pages = sum(-(-(c + n) // cfg.block_size) for c, n in seqs) + 1
    shape = (copies * pages, 1, 2, cfg.num_kv_heads, cfg.block_size, cfg.head_dim)
    return torch.empty(shape, device=device, dtype=cfg.dtype)


def paged_problems(pool, seqs, copies, cfg, device):
    """`copies` independent batches for seqs = [(context, q_len)] over disjoint random pages of `pool`, each
    from shadowprefill.ops.testing.random_batch (the tests' builder: random K/V, NaN tails and padding)."""
    needed = sum(-(-(c + n) // cfg.block_size) for c, n in seqs) + 1
    if copies * needed > pool.shape[0]:
        raise ValueError(f"pool of {pool.shape[0]} pages < {copies} x {needed}")
    perm = torch.randperm(pool.shape[0])[:copies * needed].tolist()
    problems = []
    for c in range(copies):
        b = random_batch(seqs, pool, 0, cfg.num_q_heads, block_ids=perm[c * needed:(c + 1) * needed])
        problems.append(dict(q=b["q"], block_table=b["block_table"], cu=b["cu_seqlens_q"], lens=b["seq_lens"],
                             out=torch.empty_like(b["q"])))
    return problems


def attention_calls(pool, problems, cfg, tiles=None):
    return [lambda p=p: tk.paged_attention(p["q"], pool, 0, p["block_table"], p["cu"], p["lens"], cfg.scale,
                                           p["out"], tiles=tiles) for p in problems]


def plan_note(seqs, cfg, device, tiles=None) -> str:
    tokens = sum(n for _, n in seqs)
    max_context = max(c + n for c, n in seqs)
    plans = launch.plan_attention(tokens, len(seqs), cfg.head_dim, cfg.num_q_heads // cfg.num_kv_heads,
                                  cfg.num_kv_heads, -(-max_context // cfg.block_size) * cfg.block_size,
                                  cfg.dtype, launch.device_limits(device), tiles)
    return ", ".join(p.tile.spec + (f" split{p.num_splits}" if p.num_splits > 1 else "") for p in plans)


def problem_bytes(seqs, cfg) -> int:
    tokens = sum(n for _, n in seqs)
    return sum(c + n for c, n in seqs) * cfg.token_kv_bytes + 2 * tokens * cfg.num_q_heads * cfg.head_dim * cfg.elem


def causal_flops(context: int, chunk: int, cfg) -> int:
    """Two matmuls over the visible keys of every query: 4 * Hq * D * sum_i (context + i + 1)."""
    return 4 * cfg.num_q_heads * cfg.head_dim * (chunk * context + chunk * (chunk + 1) // 2)


def time_prefill(table, section, device, cfg, context, chunk, ceil, results, peers=True, tiles=None,
                 kind="prefill"):
    """Time one chunk-on-context shape (ours, then the SDPA peers); add its row; return TFLOP/s. Results go
    to results[kind + "_rate"], [kind + "_vs_peer"] (vs the best peer) and [kind + "_peers"] (ours / each
    peer, flash and cuDNN apart)."""
    seqs = [(context, chunk)]
    copies = timing.rotation_count(problem_bytes(seqs, cfg), timing.l2_bytes(device), cap=8)
    pool = pool_for(seqs, copies, cfg, device)
    problems = paged_problems(pool, seqs, copies, cfg, device)
    seconds = timing.median_seconds(attention_calls(pool, problems, cfg, tiles), device)
    rate = causal_flops(context, chunk, cfg) / seconds
    peer_text, vs_peer, notes = "", None, []
    if peers:
        found = sdpa_peers(pool, problems, cfg, device)
        timed = {name: s for name, (s, err, note) in found.items() if s is not None}
        peer_text = ", ".join(f"{name} {causal_flops(context, chunk, cfg) / s / 1e12:.3g}" for name, s in timed.items())
        notes += [f"{name}: {note}" for name, (s, err, note) in found.items() if note]
        if timed:
            best = min(timed.values())
            vs_peer = best / seconds
            results.setdefault(kind + "_vs_peer", {})[(context, chunk)] = vs_peer
            results.setdefault(kind + "_peers", {})[(context, chunk)] = {n: s / seconds for n, s in timed.items()}
    results.setdefault(kind + "_rate", {})[(context, chunk)] = rate
    label = " ".join(f"{kind}={spec}" for kind, spec in (tiles or {}).items())
    table.add(section, f"chunk {chunk} on ctx {context}" + (f" tiles {label}" if tiles else ""), rate / 1e12,
              "TFLOP/s", rate / ceil["matmul"] if "matmul" in ceil else None,
              peer_text and f"SDPA TFLOP/s: {peer_text}", vs_peer,
              "; ".join([f"{seconds * 1e3:.3f} ms", plan_note(seqs, cfg, device, tiles)] + notes))
    del pool, problems
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rate


def sdpa_peers(pool, problems, cfg, device) -> dict:
    """{backend: (seconds or None, rel. difference of its output from ours, note)} for torch's SDPA flash
    and cuDNN backends on the same problems (dense K/V gathered and expanded to Hq heads, not timed), with
    the bottom-right causal mask of a chunk on cached context. A backend that fails, or whose output
    differs from ours by more than 2e-2 (another mask), is reported and not timed."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

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

    def public(backend):
        def call(q, k, v):
            mask = causal_lower_right(q.shape[2], k.shape[2])
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=cfg.scale)
        return call

    def aten_flash(q, k, v):  # flash's is_causal is bottom-right for seq_q < seq_k
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=cfg.scale)[0]

    if device.type == "cuda":
        candidates = {"flash": [public(SDPBackend.FLASH_ATTENTION), aten_flash],
                      "cudnn": [public(SDPBackend.CUDNN_ATTENTION)]}
    else:
        candidates = {"math (dry run)": [public(SDPBackend.MATH)]}
    ours = problems[0]["out"].double()
    found = {}
    for name, calls in candidates.items():
        found[name] = (None, None, "")
        for call in calls:
            try:
                theirs = call(*dense[0])[0].transpose(0, 1).double()
                err = float((ours - theirs).norm() / theirs.norm())
                if not err < 2e-2:
                    found[name] = (None, err, f"output differs from ours by {err:.1e}: not timed")
                    continue
                seconds = timing.median_seconds([lambda d=d: call(*d) for d in dense], device)
                found[name] = (seconds, err, "")
                break
            except Exception as e:  # noqa: BLE001 - a peer failing must not hide our number
                found[name] = (None, None, f"{type(e).__name__}: {str(e)[:90]}")
    del dense
    return found


def prefill(table, device, ceil, dry, deadline, results):
    cfg = Config(dry)
    chunk, contexts = (32, (0, 64)) if dry else (2048, (0, 8192, 32768, 65536))
    for context in contexts:
        if time.time() > deadline:
            table.add("prefill", f"chunk {chunk} on ctx {context}", None, "", note="skipped: time budget")
            continue
        time_prefill(table, "prefill", device, cfg, context, chunk, ceil, results)


def short_chunks(table, device, ceil, dry, deadline, results):
    """The shadow-prefill case: 128-512 new tokens on 16K-64K of cached context (split along the keys)."""
    cfg = Config(dry)
    shapes = [(600, 16), (1200, 32)] if dry else [(c, n) for c in (16384, 32768, 65536) for n in (128, 256, 512)]
    for context, chunk in shapes:
        if time.time() > deadline:
            table.add("short chunk", f"chunk {chunk} on ctx {context}", None, "", note="skipped: time budget")
            continue
        time_prefill(table, "short chunk", device, cfg, context, chunk, ceil, results, kind="short")


def decode_shapes(dry):
    """(goal shapes: batch >= 64 x >= 8K and 1 x 128K; the rest of the batch x context grid)."""
    if dry:
        return [(2, 64), (1, 1024)], [(4, 64)]
    goal = [(64, 8192), (256, 8192), (64, 32768), (1, 131072)]
    rest = [(b, c) for b in (1, 8, 64, 256) for c in (1024, 8192, 32768, 131072) if (b, c) not in goal]
    return goal, rest


def decode(table, device, ceil, dry, deadline, results, which="goal"):
    cfg = Config(dry)
    l2 = timing.l2_bytes(device)
    goal, rest = decode_shapes(dry)
    for batch, context in (goal if which == "goal" else rest):
        name = f"batch {batch} x ctx {context}"
        kv = batch * context * cfg.token_kv_bytes
        if kv > MAX_KV_GIB * GIB:
            table.add("decode", name, None, "", note=f"skipped: KV {kv / GIB:.0f} GiB > {MAX_KV_GIB:g} GiB")
            continue
        if time.time() > deadline:
            table.add("decode", name, None, "", note="skipped: time budget")
            continue
        copies = timing.rotation_count(kv, l2)
        seqs = [(context - 1, 1)] * batch
        pool = pool_for(seqs, copies, cfg, device)
        problems = paged_problems(pool, seqs, copies, cfg, device)
        seconds = timing.median_seconds(attention_calls(pool, problems, cfg), device)
        rate = kv / seconds
        results.setdefault("decode", {})[(batch, context)] = rate / ceil["copy"]
        table.add("decode", name, rate / 1e9, "GB/s KV", rate / ceil["copy"],
                  note=f"{seconds * 1e6:.1f} us; {plan_note(seqs, cfg, device)}")
        del pool, problems
        if device.type == "cuda":
            torch.cuda.empty_cache()


def mixed(table, device, ceil, dry, deadline, results):
    """64 decodes at 8K plus one chunk in one call vs the two apart: a 2,048-token chunk at 16K, and the
    shadow-prefill step, a 256-token chunk at 32K (its launch split along the keys)."""
    cfg = Config(dry)
    decodes = [(63, 1)] * 4 if dry else [(8191, 1)] * 64
    for chunk in ([[(64, 32)]] if dry else [[(16384, 2048)], [(32768, 256)]]):
        if time.time() > deadline:
            table.add("mixed", f"{len(decodes)} decodes + chunk {chunk[0][1]} at {chunk[0][0]}", None, "",
                      note="skipped: time budget")
            continue
        variants = {"mixed": decodes + chunk, "decodes": decodes, "chunk": chunk}
        copies = timing.rotation_count(problem_bytes(variants["mixed"], cfg), timing.l2_bytes(device), cap=16)
        pool = pool_for(variants["mixed"], copies, cfg, device)
        seconds = {}
        for name, seqs in variants.items():
            problems = paged_problems(pool, seqs, copies, cfg, device)
            seconds[name] = timing.median_seconds(attention_calls(pool, problems, cfg), device)
        apart = seconds["decodes"] + seconds["chunk"]
        table.add("mixed", f"{len(decodes)} decodes + chunk {chunk[0][1]} at {chunk[0][0]}", seconds["mixed"] * 1e3,
                  "ms", None, f"separately {apart * 1e3:.3f} ms", apart / seconds["mixed"],
                  f"decodes {seconds['decodes'] * 1e3:.3f} ms + chunk {seconds['chunk'] * 1e3:.3f} ms; "
                  f"{plan_note(variants['mixed'], cfg, device)}")
        del pool


# the default (overlapped main loop, 1 CTA/SM), the previous loop, the two-CTA overlapped tile, the previous
# two-CTA-capable tile, a narrower overlapped tile (bench/sm90_compile_report.py shows each one's resources)
SWEEP_PREFILL = ["128x64w8s3o", "128x64w8s3", "64x32w4s4o", "64x64w4s3", "128x32w8s3o"]
SWEEP_DECODE = ["16x64w4s3", "16x32w4s3", "16x64w4s4"]
DRY_SWEEP_PREFILL = ["32x32w4s3o", "32x32w4s3"]


def prefill_tile_sweep(table, device, ceil, dry, deadline, results):
    """The prefill tiles on a 2,048-token chunk and a 256-token chunk at 32K (launch.parse_tile syntax; the
    first is the default): the first timing rows of the run (before the ceilings, so no vs-ceiling column),
    old and new main loop side by side."""
    cfg = Config(dry)
    prefill_shapes = [(64, 32)] if dry else [(32768, 2048), (32768, 256)]
    prefill_tiles = DRY_SWEEP_PREFILL if dry else SWEEP_PREFILL
    for context, chunk in prefill_shapes:
        for spec in prefill_tiles:
            if time.time() > deadline:
                table.add("tile sweep", f"chunk {chunk} on ctx {context} tiles prefill={spec}", None, "",
                          note="skipped: time budget")
                continue
            rate = time_prefill(table, "tile sweep", device, cfg, context, chunk, ceil, {}, peers=False,
                                tiles={"prefill": spec})
            results.setdefault("sweep", {})[(context, chunk, spec)] = rate


def decode_tile_sweep(table, device, ceil, dry, deadline, results):
    """Decode tiles on 64 x 8K, while time remains (the first is the default)."""
    cfg = Config(dry)
    batch, context = (2, 64) if dry else (64, 8192)
    kv = batch * context * cfg.token_kv_bytes
    copies = timing.rotation_count(kv, timing.l2_bytes(device))
    seqs = [(context - 1, 1)] * batch
    pool = pool_for(seqs, copies, cfg, device)
    problems = paged_problems(pool, seqs, copies, cfg, device)
    for spec in (["16x16w4s3"] if dry else SWEEP_DECODE):
        if time.time() > deadline:
            table.add("tile sweep", f"decode {batch} x {context} tiles decode={spec}", None, "",
                      note="skipped: time budget")
            continue
        tiles = {"decode": spec}
        seconds = timing.median_seconds(attention_calls(pool, problems, cfg, tiles), device)
        table.add("tile sweep", f"decode {batch} x {context} tiles decode={spec}", kv / seconds / 1e9, "GB/s KV",
                  kv / seconds / ceil["copy"], note=f"{seconds * 1e6:.1f} us; {plan_note(seqs, cfg, device, tiles)}")
