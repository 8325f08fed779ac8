"""Launch planning for the Triton kernels: tiles, a resource model, resident capacity and KV splits.

Everything here is a pure function of shapes the host already knows (token count T, sequence count S,
head dim, GQA ratio, block_table width, the device's limits), so planning a launch never synchronises
with the device and a plan can be captured in a CUDA graph.

- Tiles (`attention_tile`) are starting points from the usual FlashAttention-2 shapes for Hopper (128-row
  query tiles of 64 keys, 8 warps at head_dim 128; 16-row decode tiles). The kernel fetches page ids one
  key tile ahead (attention.py), so num_stages = 3 keeps two K/V tiles in flight;
  bench/sm90_compile_report.py asserts that from the compiled TTGIR for Triton 3.6 and 3.9.
- `tile_resources` models the shared memory and registers of a tile; the compile report checks the model
  against the compiler's numbers for every variant (the model must never be below them).
- `resident_capacity` = CTAs per SM (threads, registers, shared memory) x SMs; a launch whose programs
  fill less than that is split along the keys (flash-decoding), decodes and prefill chunks alike: a
  128-512-token shadow-prefill chunk on a long context launches few query tiles and is split too.
- Tiles can be overridden (`SHADOWPREFILL_ATTENTION_TILES`, `forced_tiles`, or the kernels' `tiles=`
  argument) so that one GPU run can sweep them; splits likewise (`SHADOWPREFILL_KV_SPLITS`,
  `forced_splits`). The serving path never forces either.
"""
import contextlib
import functools
import os
import re
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional

import torch

MIN_TOKENS_PER_SPLIT = 512  # a KV split shorter than this costs more in the reduce than it gains
MAX_SPLITS = 64
TILES_ENV = "SHADOWPREFILL_ATTENTION_TILES"
SPLITS_ENV = "SHADOWPREFILL_KV_SPLITS"
TILE_KINDS = ("decode", "prefill")

_forced_splits: Optional[int] = None
_forced_tiles: dict = {}


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- device limits ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DeviceLimits:
    """Per-SM resources that bound how many CTAs of a kernel are resident at once."""
    sms: int
    smem_per_sm: int          # bytes of shared memory per SM (all CTAs together)
    smem_per_block: int       # the most one CTA may use (opt-in limit)
    regs_per_sm: int
    max_threads_per_sm: int
    max_ctas_per_sm: int = 32
    smem_reserved_per_cta: int = 1024  # the runtime keeps 1 KB of each CTA's shared memory (sm_80+)


H100_LIMITS = DeviceLimits(sms=132, smem_per_sm=228 * 1024, smem_per_block=227 * 1024, regs_per_sm=65536,
                           max_threads_per_sm=2048)  # H100 / H200 SXM (sm_90): what CPU runs plan for


@functools.lru_cache(maxsize=None)
def _cuda_limits(index: int) -> DeviceLimits:
    p = torch.cuda.get_device_properties(index)
    d = H100_LIMITS
    return DeviceLimits(sms=p.multi_processor_count,
                        smem_per_sm=getattr(p, "shared_memory_per_multiprocessor", d.smem_per_sm),
                        smem_per_block=getattr(p, "shared_memory_per_block_optin", d.smem_per_block),
                        regs_per_sm=getattr(p, "regs_per_multiprocessor", d.regs_per_sm),
                        max_threads_per_sm=getattr(p, "max_threads_per_multi_processor", d.max_threads_per_sm))


def device_limits(device: torch.device) -> DeviceLimits:
    """Limits of a CUDA device (read once); H100_LIMITS on the CPU (interpreter runs plan like an H100)."""
    if device.type == "cuda":
        return _cuda_limits(device.index if device.index is not None else torch.cuda.current_device())
    return H100_LIMITS


def sm_count(device: torch.device) -> int:
    return device_limits(device).sms


def is_interpreted(kernel) -> bool:
    """True when `kernel` was decorated under TRITON_INTERPRET=1 (it then runs on CPU tensors)."""
    return type(kernel).__name__ == "InterpretedFunction"


# ---- tiles ------------------------------------------------------------------------------------------------

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
    overlap: bool = False  # the unmasked key loop issues the next tile's scores before this tile's softmax

    @property
    def block_m(self) -> int:
        return self.block_q * self.group_padded

    @property
    def spec(self) -> str:
        """The override syntax of this tile: ROWSxKEYSwWARPSsSTAGES[o], e.g. 128x64w8s3 or 128x64w8s3o."""
        return f"{self.block_m}x{self.block_n}w{self.num_warps}s{self.num_stages}" + ("o" if self.overlap else "")


def attention_tile(head_dim: int, group: int, dtype: torch.dtype, decode: bool,
                   override: Optional[str] = None) -> AttentionTile:
    """Tile for query tiles of decodes / short chunks (`decode`) or of prefill chunks.

    decode: 16 rows (the smallest tl.dot tile), as many tokens as the GQA group leaves room for, 4 warps;
    the kernel is bound by reading K/V, so rows beyond the real queries are nearly free.
    prefill: 128 rows at head_dim <= 128, 64 at 256, 8 warps (4 spill registers at head_dim 256).
    64 keys per step (32 at head_dim 256), three stages: two K/V tiles in flight while one is consumed.
    16-bit prefill tiles at head_dim <= 128 use the overlapped main loop (`overlap`, spec suffix "o": the
    softmax of one key tile runs while the P.V wgmma of the previous one is in flight; see
    attention._attend_keys_overlap); "128x64w8s3" selects the previous loop, "64x32w4s4o" a tile of which
    two CTAs fit one H100 SM (bench/sm90_compile_report.py shows all three).
    float32 (3-pass tf32 dots): 32 keys, at most 32 rows (16 at head_dim 256), 4 warps.
    `override` (a TileSpec string such as "128x64w8s3") replaces rows, keys, warps and stages. Rows are
    raised to the padded GQA group; a tile whose modelled shared memory exceeds one CTA's (H100 limit)
    gives up keys, then rows, then stages until it fits.
    """
    group_padded = next_power_of_2(group)
    head_dim_padded = max(16, next_power_of_2(head_dim))
    rows = 16 if decode else (128 if head_dim_padded <= 128 else 64)
    block_n = 64 if head_dim_padded <= 128 else 32
    num_warps = 4 if decode else 8
    num_stages = 3
    overlap = not decode and dtype != torch.float32 and head_dim_padded <= 128
    if dtype == torch.float32:
        block_n, num_warps = 32, 4
        rows = min(rows, 32 if head_dim_padded <= 128 else 16)
    if override is not None:
        rows, block_n, num_warps, num_stages, overlap = parse_tile(
            override, f"{'decode' if decode else 'prefill'} tile")
    rows = max(rows, group_padded)

    def tile():
        return AttentionTile(block_q=rows // group_padded, group_padded=group_padded, block_n=block_n,
                             head_dim_padded=head_dim_padded, num_warps=num_warps, num_stages=num_stages,
                             overlap=overlap)

    while tile_resources(tile(), dtype)[0] > H100_LIMITS.smem_per_block:
        if block_n > 16:
            block_n //= 2
        elif rows > max(16, group_padded):
            rows //= 2
        elif num_stages > 2:
            num_stages -= 1
        else:
            break
    return tile()


_TILE_RE = re.compile(r"^(\d+)x(\d+)w(\d+)s(\d+)(o?)$")


def parse_tile(spec: str, name: str = "tile") -> tuple:
    """"ROWSxKEYSwWARPSsSTAGES[o]" -> (rows, keys, warps, stages, overlap), each checked; ValueError naming
    `name`. A trailing "o" selects the overlapped main loop (attention._attend_keys_overlap)."""
    match = _TILE_RE.match(str(spec).strip())
    if not match:
        raise ValueError(f"{name}: expected ROWSxKEYSwWARPSsSTAGES[o] such as 128x64w8s3, got {spec!r}")
    rows, keys, warps, stages = (int(g) for g in match.groups()[:4])
    overlap = match.group(5) == "o"
    for value, what, low, high in ((rows, "rows", 16, 256), (keys, "keys", 16, 256), (warps, "warps", 1, 16)):
        if value & (value - 1) or not low <= value <= high:
            raise ValueError(f"{name}: {what} must be a power of two in [{low}, {high}], got {value} in {spec!r}")
    if not 1 <= stages <= 6:
        raise ValueError(f"{name}: stages must be in [1, 6], got {stages} in {spec!r}")
    return rows, keys, warps, stages, overlap


def _parse_tiles(tiles, name: str) -> dict:
    """{"decode": spec, "prefill": spec} from a mapping or a "decode=16x64w4s3,prefill=..." string."""
    if tiles is None:
        return {}
    if isinstance(tiles, str):
        items = [part.split("=", 1) for part in tiles.split(",") if part.strip()]
        if any(len(item) != 2 for item in items):
            raise ValueError(f"{name}: expected 'decode=SPEC,prefill=SPEC', got {tiles!r}")
        tiles = {k.strip(): v.strip() for k, v in items}
    if not isinstance(tiles, Mapping):
        raise TypeError(f"{name}: expected a mapping or a string, got {type(tiles).__name__}")
    for kind, spec in tiles.items():
        if kind not in TILE_KINDS:
            raise ValueError(f"{name}: unknown tile kind {kind!r}; expected {' or '.join(TILE_KINDS)}")
        parse_tile(spec, f"{name}[{kind}]")
    return dict(tiles)


def tile_overrides(tiles=None) -> dict:
    """The tile overrides in force: the `tiles` argument, else forced_tiles(), else SHADOWPREFILL_ATTENTION_TILES."""
    if tiles is not None:
        return _parse_tiles(tiles, "tiles")
    if _forced_tiles:
        return dict(_forced_tiles)
    return dict(_env_tiles(os.environ.get(TILES_ENV) or None))


@functools.lru_cache(maxsize=8)
def _env_tiles(value: Optional[str]) -> tuple:
    return tuple(_parse_tiles(value, TILES_ENV).items())


@contextlib.contextmanager
def forced_tiles(**tiles: str) -> Iterator[None]:
    """Within the block, paged attention uses these tiles, e.g. forced_tiles(prefill="128x32w8s3")."""
    global _forced_tiles
    parsed = _parse_tiles(tiles, "forced_tiles")
    previous, _forced_tiles = _forced_tiles, parsed
    try:
        yield
    finally:
        _forced_tiles = previous


@contextlib.contextmanager
def forced_splits(num_splits: Optional[int]) -> Iterator[None]:
    """Within the block, paged attention uses `num_splits` KV splits (1 = no split) for every batch, in
    one decode-tile launch. For tests and benchmarks; `SHADOWPREFILL_KV_SPLITS=n` does the same for a
    whole process."""
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
    env = os.environ.get(SPLITS_ENV)
    if env:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if not 1 <= n <= MAX_SPLITS:
            raise ValueError(f"{SPLITS_ENV}: expected 1..{MAX_SPLITS}, got {env!r}")
        return n
    return None


# ---- resources and capacity -------------------------------------------------------------------------------

def uses_wgmma(tile: AttentionTile, dtype: torch.dtype) -> bool:
    """Whether Triton lowers the tile's dots to Hopper wgmma (64+ rows, 4+ warps, 16-bit or tf32 operands):
    a wgmma consumes its operands from shared memory asynchronously, which holds one more K/V buffer."""
    return tile.block_m >= 64 and tile.num_warps >= 4


def tile_resources(tile: AttentionTile, dtype: torch.dtype) -> tuple:
    """(shared memory bytes, registers per thread) of the attention kernel with this tile: a model.

    Shared memory: the K and V buffers (num_stages - 1 in flight, one more under wgmma) plus the staging
    of q (and of p for the second dot, except under wgmma), in the input dtype. Registers: the fp32
    accumulator and scores, the q fragment and the K/V address vectors spread over the CTA's threads, plus
    a fixed part and a quarter for temporaries; capped at 255.
    bench/sm90_compile_report.py checks both against the compiler for every variant (never below).
    """
    elem = torch.tensor([], dtype=dtype).element_size()
    threads = 32 * tile.num_warps
    wgmma = uses_wgmma(tile, dtype)
    buffers = max(1, tile.num_stages - 1) + (1 if wgmma else 0)
    kv_tile = tile.block_n * tile.head_dim_padded * elem
    p_staging = 0 if wgmma else tile.block_m * tile.block_n * elem  # wgmma takes p from registers
    smem = 2 * buffers * kv_tile + tile.block_m * tile.head_dim_padded * elem + p_staging + 4 * tile.block_n
    if tile.overlap:  # the first K tile of the overlapped loop is staged outside the pipelined buffers
        smem += kv_tile
    if dtype == torch.float32:  # 3-pass tf32 dots stage q and p a second time and need every register
        return smem + tile.block_m * (tile.head_dim_padded + tile.block_n) * 4, 255
    scores = (2 if tile.overlap else 1) * tile.block_m * tile.block_n * 4  # the overlap carries the next scores
    tile_bytes = (tile.block_m * tile.head_dim_padded * 4 + scores                            # acc, scores
                  + tile.block_m * tile.head_dim_padded * elem                                # q fragment
                  + 2 * tile.block_n * tile.head_dim_padded * 2)                              # K/V addresses
    per_thread = tile_bytes // (4 * threads)
    regs = min(255, 48 + per_thread + per_thread // 4)
    return smem, regs


def ctas_per_sm(tile: AttentionTile, dtype: torch.dtype, limits: DeviceLimits = H100_LIMITS) -> int:
    """Resident CTAs of this tile per SM: the tightest of threads, registers and shared memory."""
    smem, regs = tile_resources(tile, dtype)
    threads = 32 * tile.num_warps
    regs_per_warp = 256 * cdiv(regs * 32, 256)  # allocated per warp in units of 256
    by_threads = limits.max_threads_per_sm // threads
    by_regs = limits.regs_per_sm // (regs_per_warp * tile.num_warps)
    by_smem = limits.smem_per_sm // (smem + limits.smem_reserved_per_cta) if smem <= limits.smem_per_block else 0
    return max(1, min(by_threads, by_regs, by_smem, limits.max_ctas_per_sm))


def resident_capacity(tile: AttentionTile, dtype: torch.dtype, limits: DeviceLimits = H100_LIMITS) -> int:
    """CTAs of this tile the whole device holds at once (one wave)."""
    return ctas_per_sm(tile, dtype, limits) * limits.sms


def num_kv_splits(programs: int, max_context: int, capacity: int) -> int:
    """KV splits for a launch of `programs` busy CTAs on a device holding `capacity` of them at once.

    Splitting pays when the programs alone leave resident slots idle: split into capacity // programs
    pieces (one full wave), never below MIN_TOKENS_PER_SPLIT keys per split of the longest context (the
    largest seq_len where the host has it for free, else block_table width * block_size), at most
    MAX_SPLITS. The kernel applies the same floor per sequence from its real length, so a short context
    in a wide launch uses fewer of the splits.
    """
    if programs <= 0 or 2 * programs > capacity:
        return 1
    splits = min(capacity // programs, max_context // MIN_TOKENS_PER_SPLIT, MAX_SPLITS)
    return max(1, splits)


# ---- plans ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttentionLaunch:
    """One kernel launch of a paged attention call: its tile, the q_len range of the sequences it takes
    (the others exit at once), its KV split count (1 = none), and the busy programs it was sized for."""
    tile: AttentionTile
    q_len_min: int
    q_len_max: int
    num_splits: int
    programs: int = 0


Q_LEN_UNBOUNDED = 2**31 - 1


def busy_tiles(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Upper bound on the query tiles that hold at least one token: each holds >= 1 token, and the tiles
    of S sequences number at most cdiv(T, block_q) + S - 1."""
    return min(num_tokens, cdiv(num_tokens, block_q) + max(0, num_seqs - 1))


def plan_attention(num_tokens: int, num_seqs: int, head_dim: int, group: int, num_kv_heads: int,
                   max_context: int, dtype: torch.dtype, limits: DeviceLimits = H100_LIMITS,
                   tiles=None) -> list:
    """The launches that together compute a paged attention call, from host-known shapes only.

    - every sequence a decode (T == S), a tiny batch, or forced splits: one decode-tile launch that takes
      all sequences (correct for any q_len, merely slower for a long chunk);
    - one sequence of T > decode block_q tokens: one prefill-tile launch;
    - otherwise (a mix): the decode tile for sequences of q_len <= its block_q, the prefill tile for the
      rest; the programs of a launch whose sequence belongs to the other launch return at once.
    Each launch is split along the keys when its busy programs fill less than half of the device's
    resident capacity for its tile (num_kv_splits); busy programs are an upper bound, except for the
    prefill launch of a mix (see below).
    """
    overrides = tile_overrides(tiles)
    decode = attention_tile(head_dim, group, dtype, True, overrides.get("decode"))

    def sized(tile, q_min, q_max, tiles_busy, splits=None):
        programs = tiles_busy * num_kv_heads
        if splits is None:
            splits = num_kv_splits(programs, max_context, resident_capacity(tile, dtype, limits))
        return AttentionLaunch(tile, q_min, q_max, splits, programs)

    forced = forced_num_splits()
    if forced is not None or num_tokens == num_seqs or num_tokens <= decode.block_q:
        return [sized(decode, 0, Q_LEN_UNBOUNDED, busy_tiles(num_tokens, num_seqs, decode.block_q), forced)]
    prefill = attention_tile(head_dim, group, dtype, False, overrides.get("prefill"))
    if num_seqs == 1:
        return [sized(prefill, 0, Q_LEN_UNBOUNDED, cdiv(num_tokens, prefill.block_q))]
    # which sequences are decodes is not known on the host: size the prefill launch for the usual engine
    # step, S - 1 single-token decodes next to one chunk (a shadow chunk among decodes gets its splits;
    # many short prefills are under-counted, which costs extra splits, never a wrong result)
    return [sized(decode, 0, decode.block_q, min(num_seqs, num_tokens)),
            sized(prefill, decode.block_q + 1, Q_LEN_UNBOUNDED,
                  cdiv(max(1, num_tokens - (num_seqs - 1)), prefill.block_q))]


def num_query_tiles(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Query tiles of the launch grid for any split of T tokens into S sequences: cdiv(T, block_q) + S.

    Sequence s owns tiles [cu_q[s] // block_q + s, cu_q[s+1] // block_q + s + 1); the kernel finds s by
    binary search over cu_seqlens_q, so the grid needs no device-to-host copy.
    """
    return cdiv(num_tokens, block_q) + num_seqs


# ---- copies -----------------------------------------------------------------------------------------------

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
