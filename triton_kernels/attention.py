"""Paged attention over any engine's KV layout: one kernel for any mix of decodes and prefill chunks.

K and V are two views key_cache / value_cache [num_blocks, block_size, Hkv, D] with any strides but a
contiguous last dimension (vLLM's kv[0] / kv[1], FlashInfer NHD / HND, this project's block-major page
kv_cache[:, layer, 0 / 1].transpose(1, 2); DESIGN.md §3-4): token j of sequence s lives in page
block_table[s, j // block_size] at row j % block_size.

A program takes one query tile (block_q consecutive tokens of one sequence, times the query heads of one KV
head: GQA packing) and walks the keys in three ranges so that only boundary tiles pay for masks:
  [lo, full_lo)       keys some row cannot see because of the sliding window   (masked)
  [full_lo, full_hi)  keys every row of the tile sees                          (no masks at all)
  [full_hi, kv_end)   the causal diagonal and the unwritten tail of the page   (masked)
Keys past the last query of the tile are never loaded (causal tile skipping). Masked loads use other=0,
so a NaN in the unwritten tail of the last page never reaches the arithmetic.
With SPLIT (attention_split.py) the key range is cut into num_splits pieces and the program writes its
piece's partial result plus its log-sum-exp for the reduce kernel.
The grid is flat: program id -> (query tile, KV head, split), tiles in reverse order, so a causal prefill
without context starts its longest tiles (the last queries see the most keys) first and the short ones
fill the tail of the wave.
"""
import torch
import triton
import triton.language as tl

from . import launch

LOG2_E = 1.4426950408889634


@triton.jit
def _find_query_tile(cu_seqlens_q_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """(sequence, tile index) of query tile `pid`: the largest s with cu_q[s] // BLOCK_Q + s <= pid."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        right = first_tile <= pid
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right, hi, mid)
    seq = lo - 1
    tile = pid - (tl.load(cu_seqlens_q_ptr + seq) // BLOCK_Q + seq)
    return seq, tile


@triton.jit
def _load_pages(block_table_row, start, key_hi, kv_valid_lo, seq_len, BLOCK_N: tl.constexpr,
                BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """Page id of each key of the tile at `start`: MASKED, of the keys in [kv_valid_lo, seq_len) (the mask
    of the K/V loads); else of the keys before key_hi (whole tiles of valid keys). 0 elsewhere."""
    offs_n = start + tl.arange(0, BLOCK_N)
    if MASKED:
        ok = (offs_n < seq_len) & (offs_n >= kv_valid_lo)
    else:
        ok = offs_n < key_hi
    return tl.load(block_table_row + offs_n // BLOCK_SIZE, mask=ok, other=0)


@triton.jit
def _kv_offsets(page, offs_n, offs_d, stride_b, stride_t, BLOCK_SIZE: tl.constexpr):
    """Element offsets [BLOCK_N, HEAD_DIM_P] of the keys offs_n living on pages `page` (int64)."""
    in_page = (offs_n % BLOCK_SIZE).to(tl.int64)
    return (page.to(tl.int64) * stride_b + in_page * stride_t)[:, None] + offs_d[None, :]


@triton.jit
def _load_kv(base, offs, mask, d_ok, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr):
    """One K or V tile: masked rows (MASKED) or padded head dims read as 0."""
    if MASKED:
        return tl.load(base + offs, mask=mask, other=0.0)
    elif HEAD_DIM != HEAD_DIM_P:
        return tl.load(base + offs, mask=d_ok[None, :], other=0.0)
    else:
        return tl.load(base + offs)


@triton.jit
def _scores(qk, qk_scale, softcap, USE_SOFTCAP: tl.constexpr):
    """Logits in base 2: scale * q.k * log2(e), or the softcapped ones (qk_scale = scale then)."""
    if USE_SOFTCAP:
        # softcap * tanh(scale * q.k / softcap), tanh(x) = 1 - 2 / (e^{2x} + 1); then base 2
        x = qk * (qk_scale / softcap)
        qk = softcap * (1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0))
        return qk * 1.4426950408889634
    else:
        return qk * qk_scale


@triton.jit
def _attend_keys(acc, m_i, l_i, q, k_base, v_base, block_table_row, key_lo, key_hi, kv_valid_lo, seq_len,
                 query_pos, qk_scale, softcap, window, stride_kb, stride_kt, stride_vb, stride_vt,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, USE_WINDOW: tl.constexpr,
                 USE_SOFTCAP: tl.constexpr, SAME_KV_STRIDES: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online-softmax accumulation of the keys [key_lo, key_hi) (key_lo a multiple of BLOCK_N).

    MASKED: loads only keys in [kv_valid_lo, seq_len) and applies the causal / window mask per row;
    otherwise every key of the range is valid for every row and nothing is masked.
    """
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_ok = offs_d < HEAD_DIM
    # Page ids are fetched one key tile ahead into registers (a loop-carried value), so the K/V loads of a
    # tile depend on no load of the same iteration: the software pipeliner then keeps num_stages - 1 K/V
    # tiles in flight instead of spending a stage on the block-table gather.
    page_next = _load_pages(block_table_row, key_lo, key_hi, kv_valid_lo, seq_len, BLOCK_N, BLOCK_SIZE, MASKED)
    for start in range(key_lo, key_hi, BLOCK_N):  # one key tile per step
        offs_n = start + tl.arange(0, BLOCK_N)
        page = page_next
        page_next = _load_pages(block_table_row, start + BLOCK_N, key_hi, kv_valid_lo, seq_len, BLOCK_N,
                                BLOCK_SIZE, MASKED)
        n_ok = (offs_n < seq_len) & (offs_n >= kv_valid_lo)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k_offs = _kv_offsets(page, offs_n, offs_d, stride_kb, stride_kt, BLOCK_SIZE)
        if SAME_KV_STRIDES:
            v_offs = k_offs
        else:
            v_offs = _kv_offsets(page, offs_n, offs_d, stride_vb, stride_vt, BLOCK_SIZE)
        k = _load_kv(k_base, k_offs, kv_mask, d_ok, MASKED, HEAD_DIM, HEAD_DIM_P)
        qk = _scores(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), qk_scale, softcap, USE_SOFTCAP)
        if MASKED:
            visible = (offs_n[None, :] <= query_pos[:, None]) & n_ok[None, :]
            if USE_WINDOW:
                visible = visible & (offs_n[None, :] > query_pos[:, None] - window)
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_kv(v_base, v_offs, kv_mask, d_ok, MASKED, HEAD_DIM, HEAD_DIM_P)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attend_keys_overlap(acc, m_i, l_i, q, k_base, v_base, block_table_row, key_lo, key_hi, qk_scale, softcap,
                         stride_kb, stride_kt, stride_vb, stride_vt, HEAD_DIM: tl.constexpr,
                         HEAD_DIM_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         USE_SOFTCAP: tl.constexpr, SAME_KV_STRIDES: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """_attend_keys for the unmasked range [key_lo, key_hi), software-pipelined by hand (the OVERLAP tiles).

    The scores of key tile j + 1 are computed at step j and carried to step j + 1, whose softmax therefore
    starts at once, before any dot of that step: on Hopper it runs while the P.V wgmma of step j (issued
    asynchronously at the end of step j, accumulating into acc) is still on the tensor cores
    (FlashAttention-3's softmax / P.V overlap, in the form Triton's wgmma pipeliner can keep in flight:
    acc is next read after the step's q.K wait). The scores computed at the last step are thrown away; they
    read the last tile again, never memory past the range. An empty range reads one tile and changes nothing.
    """
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_ok = offs_d < HEAD_DIM
    last = tl.maximum(key_hi - BLOCK_N, key_lo)  # the "next tile" of the last step: the last tile again
    page_v = _load_pages(block_table_row, key_lo, key_hi, 0, key_hi, BLOCK_N, BLOCK_SIZE, False)
    k = _load_kv(k_base, _kv_offsets(page_v, key_lo + tl.arange(0, BLOCK_N), offs_d, stride_kb, stride_kt,
                                     BLOCK_SIZE), None, d_ok, False, HEAD_DIM, HEAD_DIM_P)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # raw q.k; scaled / capped in the next step
    # page ids one step ahead, loaded for K (tile j + 1) and for V (tile j) separately: each is a value of
    # the previous step (loop distance 1), which the software pipeliner requires
    page_k = _load_pages(block_table_row, tl.minimum(key_lo + BLOCK_N, last), key_hi, 0, key_hi, BLOCK_N,
                         BLOCK_SIZE, False)
    for start in range(key_lo, key_hi, BLOCK_N):
        # softmax of this tile (q.k from the previous step), overlapping the previous step's P.V
        s = _scores(qk, qk_scale, softcap, USE_SOFTCAP)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # scores of the next tile
        offs_next = tl.minimum(start + BLOCK_N, last) + tl.arange(0, BLOCK_N)
        k_next = _load_kv(k_base, _kv_offsets(page_k, offs_next, offs_d, stride_kb, stride_kt, BLOCK_SIZE), None,
                          d_ok, False, HEAD_DIM, HEAD_DIM_P)
        qk_next = tl.dot(q, tl.trans(k_next), input_precision=DOT_PRECISION)
        offs_n = start + tl.arange(0, BLOCK_N)
        if SAME_KV_STRIDES:
            v_offs = _kv_offsets(page_v, offs_n, offs_d, stride_kb, stride_kt, BLOCK_SIZE)
        else:
            v_offs = _kv_offsets(page_v, offs_n, offs_d, stride_vb, stride_vt, BLOCK_SIZE)
        v = _load_kv(v_base, v_offs, None, d_ok, False, HEAD_DIM, HEAD_DIM_P)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
        qk = qk_next
        page_v = _load_pages(block_table_row, start + BLOCK_N, key_hi, 0, key_hi, BLOCK_N, BLOCK_SIZE, False)
        page_k = _load_pages(block_table_row, tl.minimum(start + 2 * BLOCK_N, last), key_hi, 0, key_hi, BLOCK_N,
                             BLOCK_SIZE, False)
    return acc, m_i, l_i


@triton.jit
def paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, block_table_ptr, cu_seqlens_q_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
        num_seqs, num_kv_heads, num_splits, qk_scale, softcap, window, q_len_min, q_len_max,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
        stride_vh, stride_bt, stride_pt, stride_ph, stride_ps,
        HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr,
        SAME_KV_STRIDES: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
        DOT_PRECISION: tl.constexpr, OVERLAP: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    # flat program id -> (query tile, kv head, split), longest-first: the last tile of the grid runs first
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    if SPLIT:
        split = pid % num_splits
        pid = pid // num_splits
    kv_head = pid % num_kv_heads
    seq, tile = _find_query_tile(cu_seqlens_q_ptr, num_seqs, pid // num_kv_heads, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if (tile * BLOCK_Q >= q_len) | (q_len < q_len_min) | (q_len > q_len_max):
        return  # a spare program of the upper-bound grid, or a sequence the other launch takes
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_P)
    tok_in_seq = tile * BLOCK_Q + offs_m // GROUP_P
    head_in_group = offs_m % GROUP_P
    row_ok = (tok_in_seq < q_len) & (head_in_group < GROUP)
    token = (q_start + tok_in_seq).to(tl.int64)
    q_head = kv_head * GROUP + head_in_group
    q_mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + token[:, None] * stride_qt + q_head[:, None] * stride_qh + offs_d[None, :],
                mask=q_mask, other=0.0)
    query_pos = context + tok_in_seq

    # Key ranges of this tile (see the module docstring). first/last: positions of its first/last query.
    first = context + tile * BLOCK_Q
    last = context + tl.minimum(tile * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_end = last + 1
    if USE_WINDOW:
        kv_start = tl.maximum(first - window + 1, 0)
        full_lo = tl.cdiv(tl.maximum(last - window + 1, 0), BLOCK_N) * BLOCK_N
    else:
        kv_start = first * 0
        full_lo = first * 0
    lo = (kv_start // BLOCK_N) * BLOCK_N
    full_lo = tl.maximum(lo, tl.minimum(full_lo, tl.cdiv(kv_end, BLOCK_N) * BLOCK_N))
    full_hi = tl.maximum(full_lo, ((first + 1) // BLOCK_N) * BLOCK_N)
    if SPLIT:  # this program's share of [lo, kv_end), in whole key tiles
        # at least MIN_SPLIT_TILES per split, from this sequence's real length: a short context in a launch
        # sized for a long one uses fewer splits (the programs past its last split exit with lse = -inf)
        tiles_per_split = tl.maximum(tl.cdiv(tl.cdiv(kv_end - lo, BLOCK_N), num_splits), MIN_SPLIT_TILES)
        split_lo = lo + split * tiles_per_split * BLOCK_N
        split_hi = tl.minimum(split_lo + tiles_per_split * BLOCK_N, kv_end)
    else:
        split_lo = lo
        split_hi = kv_end

    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
    block_table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: a row with no key yet stays NaN-free
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    if USE_WINDOW:  # keys some row cannot see because of the window
        acc, m_i, l_i = _attend_keys(
            acc, m_i, l_i, q, k_base, v_base, block_table_row, tl.maximum(lo, split_lo),
            tl.minimum(full_lo, split_hi), kv_start, seq_len, query_pos, qk_scale, softcap, window, stride_kb,
            stride_kt, stride_vb, stride_vt, HEAD_DIM, HEAD_DIM_P, BLOCK_N, BLOCK_SIZE, True, USE_WINDOW,
            USE_SOFTCAP, SAME_KV_STRIDES, DOT_PRECISION)
    if OVERLAP:  # keys every row sees, the next tile's scores computed during this tile's softmax
        acc, m_i, l_i = _attend_keys_overlap(
            acc, m_i, l_i, q, k_base, v_base, block_table_row, tl.maximum(full_lo, split_lo),
            tl.minimum(full_hi, split_hi), qk_scale, softcap, stride_kb, stride_kt, stride_vb, stride_vt,
            HEAD_DIM, HEAD_DIM_P, BLOCK_N, BLOCK_SIZE, USE_SOFTCAP, SAME_KV_STRIDES, DOT_PRECISION)
    else:
        acc, m_i, l_i = _attend_keys(  # keys every row sees: no masks
            acc, m_i, l_i, q, k_base, v_base, block_table_row, tl.maximum(full_lo, split_lo),
            tl.minimum(full_hi, split_hi), kv_start, seq_len, query_pos, qk_scale, softcap, window, stride_kb,
            stride_kt, stride_vb, stride_vt, HEAD_DIM, HEAD_DIM_P, BLOCK_N, BLOCK_SIZE, False, USE_WINDOW,
            USE_SOFTCAP, SAME_KV_STRIDES, DOT_PRECISION)
    acc, m_i, l_i = _attend_keys(  # the causal diagonal and the unwritten tail of the last page
        acc, m_i, l_i, q, k_base, v_base, block_table_row, tl.maximum(full_hi, split_lo),
        tl.minimum(kv_end, split_hi), kv_start, seq_len, query_pos, qk_scale, softcap, window, stride_kb,
        stride_kt, stride_vb, stride_vt, HEAD_DIM, HEAD_DIM_P, BLOCK_N, BLOCK_SIZE, True, USE_WINDOW,
        USE_SOFTCAP, SAME_KV_STRIDES, DOT_PRECISION)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if SPLIT:
        # partial result of this split, normalised by its own sum, with lse = m + log2(l) in base 2
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        part_row = token * stride_pt + q_head.to(tl.int64) * stride_ph + split * stride_ps
        tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=q_mask)
        tl.store(part_lse_ptr + part_row, lse, mask=row_ok)
    else:
        out_offs = token[:, None] * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + out_offs, o.to(out_ptr.dtype.element_ty), mask=q_mask)


def launch_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     out: torch.Tensor, sliding_window: int, softcap: float, plan: launch.AttentionLaunch,
                     part_out: torch.Tensor = None, part_lse: torch.Tensor = None) -> None:
    """Enqueue one launch of `plan` (no host sync). With plan.num_splits > 1 it writes part_out
    [T, Hq, splits, D] float32 and part_lse [T, Hq, splits] instead of `out`."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = block_table.shape[0]
    tile = plan.tile
    splits = plan.num_splits
    grid = (launch.num_query_tiles(num_tokens, num_seqs, tile.block_q) * num_kv_heads * splits,)
    if splits == 1:
        part_out = part_lse = out  # unused by the kernel in this case
        part_strides = (0, 0, 0)
    else:
        part_strides = (part_lse.stride(0), part_lse.stride(1), part_lse.stride(2))
    use_softcap = softcap > 0.0
    qk_scale = scale if use_softcap else scale * LOG2_E
    dot_precision = "tf32x3" if q.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs
    k_strides = (key_cache.stride(0), key_cache.stride(1), key_cache.stride(2))
    v_strides = (value_cache.stride(0), value_cache.stride(1), value_cache.stride(2))
    paged_attention_kernel[grid](
        q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, out, part_out, part_lse,
        num_seqs, num_kv_heads, splits, qk_scale, float(softcap), int(sliding_window),
        plan.q_len_min, plan.q_len_max,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_strides, *v_strides,
        block_table.stride(0), *part_strides,
        HEAD_DIM=head_dim, HEAD_DIM_P=tile.head_dim_padded, GROUP=num_q_heads // num_kv_heads,
        GROUP_P=tile.group_padded, BLOCK_Q=tile.block_q, BLOCK_N=tile.block_n, BLOCK_SIZE=block_size,
        SPLIT=splits > 1, SAME_KV_STRIDES=k_strides == v_strides, USE_WINDOW=sliding_window > 0,
        USE_SOFTCAP=use_softcap, DOT_PRECISION=dot_precision, OVERLAP=tile.overlap,
        MIN_SPLIT_TILES=1 if launch.forced_num_splits() else max(1, launch.MIN_TOKENS_PER_SPLIT // tile.block_n),
        num_warps=tile.num_warps,
        num_stages=tile.num_stages)


def plan(q: torch.Tensor, key_cache: torch.Tensor, block_table: torch.Tensor, tiles=None,
         seq_lens: torch.Tensor = None) -> list:
    """launch.plan_attention for these tensors. The longest context is seq_lens.max() when seq_lens is a
    CPU tensor (free to read), else the block-table width x block size (a CUDA seq_lens is never read on
    the host: no sync, graph-capturable); the kernel then caps each sequence's splits by its real length."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    max_context = block_table.shape[1] * block_size
    if seq_lens is not None and seq_lens.device.type == "cpu" and seq_lens.numel():
        max_context = min(max_context, int(seq_lens.max()))
    return launch.plan_attention(num_tokens, block_table.shape[0], head_dim, num_q_heads // num_kv_heads,
                                 num_kv_heads, max_context, q.dtype, launch.device_limits(q.device), tiles)


def paged_attention_kv(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       block_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                       out: torch.Tensor, sliding_window: int = 0, softcap: float = 0.0, tiles=None) -> None:
    """Write attention of q [T, Hq, D] over the paged key_cache / value_cache [num_blocks, block_size, Hkv, D]
    (any strides, contiguous last dim) into out [T, Hq, D].

    Inputs are validated by shadowprefill.ops (consistent shapes, ids in range). The launches come from
    launch.plan_attention: shapes only, no device-to-host copy, so the call can be captured in a CUDA
    graph. sliding_window 0 and softcap 0.0 mean off. `tiles` overrides the tile of the "decode" and/or
    "prefill" launches (e.g. {"prefill": "128x32w8s3"}; see launch.parse_tile) for tile sweeps.
    """
    from . import attention_split  # the reduce step of split launches

    if q.shape[0] == 0:
        return
    _check_supported(q.shape[2])
    for p in plan(q, key_cache, block_table, tiles, seq_lens):
        if p.num_splits == 1:
            launch_attention(q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, scale, out,
                             sliding_window, softcap, p)
        else:
            part_out, part_lse = attention_split.allocate_partials(q, p.num_splits)
            launch_attention(q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, scale, out,
                             sliding_window, softcap, p, part_out, part_lse)
            attention_split.reduce_splits(part_out, part_lse, out)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_table: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor,
                    sliding_window: int = 0, softcap: float = 0.0, tiles=None) -> None:
    """paged_attention_kv over layer `layer` of the block-major kv_cache [num_blocks, L, 2, Hkv, bs, D]."""
    paged_attention_kv(q, kv_cache[:, layer, 0].transpose(1, 2), kv_cache[:, layer, 1].transpose(1, 2),
                       block_table, cu_seqlens_q, seq_lens, scale, out, sliding_window, softcap, tiles)


def _check_supported(head_dim: int) -> None:
    if head_dim > 256:  # the tiles of launch.attention_tile stop fitting registers / shared memory
        raise ValueError(f"head_dim {head_dim} > 256 is not supported by the Triton kernels")
