"""Launch parameters for the Triton kernels: a small table plus a few rules, no autotuning.

Everything here is decided from shapes the host already knows (token count T, sequence count S, head dim,
GQA ratio, block_table width, SM count), so choosing a launch never synchronises with the device.

The tile sizes are starting points chosen from the usual FlashAttention-2 shapes for Hopper-class GPUs
(128-row query tiles, 64-key tiles, 8 warps at head_dim 128); they are not yet tuned on a GPU: the
numbers in bench/RESULTS.md, once measured, are the evidence for or against them. Shared memory,
registers and spills of every variant for sm_90: `python bench/sm90_compile_report.py` (no GPU needed).
"""
import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

CPU_SM_COUNT = 132          # what the CPU path (Triton interpreter) pretends: an H100/H200 SXM
MIN_TOKENS_PER_SPLIT = 512  # a KV split shorter than this costs more in the reduce than it gains
MAX_SPLITS = 64

_forced_splits: Optional[int] = None


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; CPU_SM_COUNT on the CPU (interpreter runs)."""
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return CPU_SM_COUNT


def is_interpreted(kernel) -> bool:
    """True when `kernel` was decorated under TRITON_INTERPRET=1 (it then runs on CPU tensors)."""
    return type(kernel).__name__ == "InterpretedFunction"


@contextlib.contextmanager
def forced_splits(num_splits: Optional[int]) -> Iterator[None]:
    """Within the block, paged_attention uses `num_splits` KV splits (1 = no split) for every batch.

    For tests and benchmarks; the serving path never forces. `SHADOWPREFILL_KV_SPLITS=n` does the same
    for a whole process.
    """
    global _forced_splits
    if num_splits is not None and not (1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits: expected 1..{MAX_SPLITS}, got {num_splits}")
    previous, _forced_splits = _forced_splits, num_splits
    try:
        yield
    finally:
        _forced_splits = previous


def forced_num_splits() -> Optional[int]:
    if _forced_splits is not None:
        return _forced_splits
    env = os.environ.get("SHADOWPREFILL_KV_SPLITS")
    if env:
        n = int(env)
        if not 1 <= n <= MAX_SPLITS:
            raise ValueError(f"SHADOWPREFILL_KV_SPLITS: expected 1..{MAX_SPLITS}, got {env!r}")
        return n
    return None


@dataclass(frozen=True)
class AttentionTile:
    """One launch configuration of the paged attention kernel.

    Rows of a tile are (token, query head) pairs: block_q consecutive tokens of one sequence times the
    group_padded query heads sharing one KV head (GQA packing), so block_m = block_q * group_padded.
    """
    block_q: int
    group_padded: int
    block_n: int
    head_dim_padded: int
    num_warps: int
    num_stages: int

    @property
    def block_m(self) -> int:
        return self.block_q * self.group_padded


def attention_tile(head_dim: int, group: int, dtype: torch.dtype, decode: bool) -> AttentionTile:
    """Tile for query tiles of decodes / short chunks (`decode`) or of prefill chunks.

    decode: 16 rows (the smallest tl.dot tile), as many tokens as the GQA group leaves room for; the
    kernel is bound by reading K/V, so rows beyond the real queries are nearly free.
    prefill: 128 rows at head_dim <= 128, 64 at 256 (registers), 64 keys per step (32 at 256).
    """
    group_padded = next_power_of_2(group)
    head_dim_padded = max(16, next_power_of_2(head_dim))
    rows = 16 if decode else (128 if head_dim_padded <= 128 else 64)
    rows = max(rows, group_padded)
    block_n = 64 if head_dim_padded <= 128 else 32
    num_stages = 3 if head_dim_padded <= 128 else 2
    if dtype == torch.float32:  # 4-byte tiles (and 3-pass tf32 dots): smaller tiles fit smem and registers
        block_n, num_stages = min(block_n, 32), 2
        rows = max(min(rows, 64), group_padded)
    if decode:
        num_warps = 4
    else:
        num_warps = 8 if rows >= 128 else 4
    return AttentionTile(block_q=rows // group_padded, group_padded=group_padded, block_n=block_n,
                         head_dim_padded=head_dim_padded, num_warps=num_warps, num_stages=num_stages)


def num_kv_splits(num_programs: int, max_context: int, num_sms: int) -> int:
    """KV splits ("flash-decoding") for a batch that launches `num_programs` query tiles.

    Splitting pays when the tiles alone cannot fill the GPU: aim at about two programs per SM, never split
    below MIN_TOKENS_PER_SPLIT keys per split of the longest possible context (block_table width *
    block_size, known without a sync), and keep the count a power of two (few compiled variants).
    """
    if num_programs <= 0 or num_programs >= num_sms:
        return 1
    wanted = cdiv(2 * num_sms, num_programs)
    by_context = max_context // MIN_TOKENS_PER_SPLIT
    splits = min(wanted, by_context, MAX_SPLITS)
    if splits <= 1:
        return 1
    return 1 << (splits.bit_length() - 1)  # round down to a power of two


@dataclass(frozen=True)
class AttentionLaunch:
    """One kernel launch of a paged_attention call: its tile, the q_len range of the sequences it takes
    (the others exit at once), and its KV split count (1 = none)."""
    tile: AttentionTile
    q_len_min: int
    q_len_max: int
    num_splits: int


Q_LEN_UNBOUNDED = 2**31 - 1


def plan_attention(num_tokens: int, num_seqs: int, head_dim: int, group: int, num_kv_heads: int,
                   max_context: int, dtype: torch.dtype, num_sms: int) -> list:
    """The launches that together compute a paged_attention call, from host-known shapes only.

    - every sequence a decode (T == S) or forced split: one decode-tile launch that takes all sequences
      (correct for any q_len, merely slower for a long chunk), split when the tiles cannot fill the GPU;
    - one sequence of T > decode block_q tokens: one prefill-tile launch;
    - otherwise (a mix): the decode tile for sequences of q_len <= its block_q, the prefill tile for the
      rest; the programs of a launch whose sequence belongs to the other launch return at once.
    """
    decode = attention_tile(head_dim, group, dtype, decode=True)
    forced = forced_num_splits()
    if forced is not None or num_tokens == num_seqs or num_tokens <= decode.block_q:
        if forced is not None:
            splits = forced
        elif num_tokens == num_seqs:
            splits = num_kv_splits(num_seqs * num_kv_heads, max_context, num_sms)
        else:
            splits = 1
        return [AttentionLaunch(decode, 0, Q_LEN_UNBOUNDED, splits)]
    prefill = attention_tile(head_dim, group, dtype, decode=False)
    if num_seqs == 1:
        return [AttentionLaunch(prefill, 0, Q_LEN_UNBOUNDED, 1)]
    return [AttentionLaunch(decode, 0, decode.block_q, 1),
            AttentionLaunch(prefill, decode.block_q + 1, Q_LEN_UNBOUNDED, 1)]


def num_query_tiles(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Upper bound on the query tiles of any split of T tokens into S sequences: cdiv(T, block_q) + S.

    Sequence s owns programs [cu_q[s] // block_q + s, cu_q[s+1] // block_q + s + 1); the kernel finds s
    by binary search over cu_seqlens_q, so the grid needs no device-to-host copy.
    """
    return cdiv(num_tokens, block_q) + num_seqs


@dataclass(frozen=True)
class CopyTile:
    """pack/unpack: units_per_program (page, layer, K/V, head) units of `unit` elements, `chunk` at a time."""
    units_per_program: int
    chunk: int
    num_chunks: int
    num_warps: int


def copy_tile(unit_elems: int, max_tile_elems: int = 8192) -> CopyTile:
    """One (page, layer, K/V, head) unit is block_size * head_dim contiguous elements in both the cache
    and the packed buffer; a program moves whole units so the fp8 scale of a unit is computed in one
    place (one pass when the unit fits a tile, else an amax pass and a quantise pass)."""
    chunk = min(next_power_of_2(unit_elems), max_tile_elems)
    units = max(1, max_tile_elems // next_power_of_2(unit_elems))
    num_chunks = cdiv(unit_elems, chunk)
    return CopyTile(units_per_program=units, chunk=chunk, num_chunks=num_chunks,
                    num_warps=8 if units * chunk >= 4096 else 4)
