"""Paged attention over the block-major KV cache: one kernel for any mix of decodes and prefill chunks.

Cache layout (DESIGN.md §3): kv_cache[num_blocks, num_layers, 2, Hkv, block_size, D]; token j of sequence s
lives in page block_table[s, j // block_size] at row j % block_size of the (layer, K/V, head) tile.

A program takes one query tile (block_q consecutive tokens of one sequence, times the query heads of one KV
head: GQA packing) and walks the keys in three ranges so that only boundary tiles pay for masks:
  [lo, full_lo)       keys some row cannot see because of the sliding window   (masked)
  [full_lo, full_hi)  keys every row of the tile sees                          (no masks at all)
  [full_hi, kv_end)   the causal diagonal and the unwritten tail of the page   (masked)
Keys past the last query of the tile are never loaded (causal tile skipping). Masked loads use other=0,
so a NaN in the unwritten tail of the last page never reaches the arithmetic.
With NUM_SPLITS > 1 (attention_split.py) the key range is cut into NUM_SPLITS pieces, program_id(2) picks
one, and the program writes an unnormalised partial result plus its log-sum-exp for the reduce kernel.
"""
import torch
import triton
import triton.language as tl

from . import launch

LOG2_E = 1.4426950408889634


@triton.jit
def _find_query_tile(cu_seqlens_q_ptr, num_seqs, BLOCK_Q: tl.constexpr):
    """(sequence, tile index) of this program: the largest s with cu_q[s] // BLOCK_Q + s <= program id."""
    pid = tl.program_id(0)
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
def _attend_keys(acc, m_i, l_i, q, k_base, v_base, block_table_row, key_lo, key_hi, kv_valid_lo, seq_len,
                 query_pos, qk_scale, softcap, window, stride_kb, stride_kt,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, USE_WINDOW: tl.constexpr,
                 USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online-softmax accumulation of the keys [key_lo, key_hi) (key_lo a multiple of BLOCK_N).

    MASKED: loads only keys in [kv_valid_lo, seq_len) and applies the causal / window mask per row;
    otherwise every key of the range is valid for every row and nothing is masked.
    """
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_ok = offs_d < HEAD_DIM
    for start in range(key_lo, key_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        if MASKED:
            n_ok = (offs_n < seq_len) & (offs_n >= kv_valid_lo)
            page = tl.load(block_table_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        else:
            page = tl.load(block_table_row + offs_n // BLOCK_SIZE).to(tl.int64)
        row = page * stride_kb + (offs_n % BLOCK_SIZE).to(tl.int64) * stride_kt  # int64 page offsets
        kv_offs = row[:, None] + offs_d[None, :]
        if MASKED:
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_base + kv_offs, mask=kv_mask, other=0.0)
        elif HEAD_DIM != HEAD_DIM_P:
            k = tl.load(k_base + kv_offs, mask=d_ok[None, :], other=0.0)
        else:
            k = tl.load(k_base + kv_offs)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if USE_SOFTCAP:
            # softcap * tanh(scale * q.k / softcap), tanh(x) = 1 - 2 / (e^{2x} + 1); then base 2
            x = qk * (qk_scale / softcap)  # qk_scale = scale here (see below)
            qk = softcap * (1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0))
            qk = qk * 1.4426950408889634
        else:
            qk = qk * qk_scale  # scale * log2(e): softmax in base 2
        if MASKED:
            visible = (offs_n[None, :] <= query_pos[:, None]) & n_ok[None, :]
            if USE_WINDOW:
                visible = visible & (offs_n[None, :] > query_pos[:, None] - window)
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_base + kv_offs, mask=kv_mask, other=0.0)
        elif HEAD_DIM != HEAD_DIM_P:
            v = tl.load(v_base + kv_offs, mask=d_ok[None, :], other=0.0)
        else:
            v = tl.load(v_base + kv_offs)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def paged_attention_kernel(
        q_ptr, kv_ptr, block_table_ptr, cu_seqlens_q_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
        num_seqs, layer_offset, qk_scale, softcap, window, q_len_min, q_len_max,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kv, stride_kh, stride_kt,
        stride_bt, stride_pt, stride_ph, stride_ps,
        HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
        USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    seq, tile = _find_query_tile(cu_seqlens_q_ptr, num_seqs, BLOCK_Q)
    kv_head = tl.program_id(1)
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
    if NUM_SPLITS > 1:  # this program's share of [lo, kv_end), in whole key tiles
        split = tl.program_id(2)
        tiles_per_split = tl.cdiv(tl.cdiv(kv_end - lo, BLOCK_N), NUM_SPLITS)
        split_lo = lo + split * tiles_per_split * BLOCK_N
        split_hi = tl.minimum(split_lo + tiles_per_split * BLOCK_N, kv_end)
    else:
        split_lo = lo
        split_hi = kv_end

    k_base = kv_ptr + layer_offset + kv_head.to(tl.int64) * stride_kh
    v_base = k_base + stride_kv
    block_table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: a row with no key yet stays NaN-free
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    if USE_WINDOW:
        acc, m_i, l_i = _attend_keys(
            acc, m_i, l_i, q, k_base, v_base, block_table_row, tl.maximum(lo, split_lo),
            tl.minimum(full_lo, split_hi), kv_start, seq_len, query_pos, qk_scale, softcap, window, stride_kb,
            stride_kt, HEAD_DIM, HEAD_DIM_P, BLOCK_N, BLOCK_SIZE, True, USE_WINDOW, USE_SOFTCAP,
            DOT_PRECISION)
    acc, m_i, l_i = _attend_keys(
        acc, m_i, l_i, q, k_base, v_base, block_table_row, tl.maximum(full_lo, split_lo),
        tl.minimum(full_hi, split_hi), kv_start, seq_len, query_pos, qk_scale, softcap, window, stride_kb,
        stride_kt, HEAD_DIM, HEAD_DIM_P, BLOCK_N, BLOCK_SIZE, False, USE_WINDOW, USE_SOFTCAP, DOT_PRECISION)
    acc, m_i, l_i = _attend_keys(
        acc, m_i, l_i, q, k_base, v_base, block_table_row, tl.maximum(full_hi, split_lo),
        tl.minimum(kv_end, split_hi), kv_start, seq_len, query_pos, qk_scale, softcap, window, stride_kb,
        stride_kt, HEAD_DIM, HEAD_DIM_P, BLOCK_N, BLOCK_SIZE, True, USE_WINDOW, USE_SOFTCAP, DOT_PRECISION)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if NUM_SPLITS > 1:
        # partial result of this split, normalised by its own sum, with lse = m + log2(l) in base 2
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        part_row = token * stride_pt + q_head.to(tl.int64) * stride_ph + split * stride_ps
        tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=q_mask)
        tl.store(part_lse_ptr + part_row, lse, mask=row_ok)
    else:
        out_offs = token[:, None] * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + out_offs, o.to(out_ptr.dtype.element_ty), mask=q_mask)


def launch_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_table: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor,
                     sliding_window: int, softcap: float, plan: launch.AttentionLaunch,
                     part_out: torch.Tensor = None, part_lse: torch.Tensor = None) -> None:
    """Enqueue one launch of `plan` (no host sync). With plan.num_splits > 1 it writes part_out
    [T, Hq, splits, D] float32 and part_lse [T, Hq, splits] instead of `out`."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[4]
    num_seqs = block_table.shape[0]
    tile = plan.tile
    splits = plan.num_splits
    grid = (launch.num_query_tiles(num_tokens, num_seqs, tile.block_q), num_kv_heads, splits)
    if splits == 1:
        part_out = part_lse = out  # unused by the kernel in this case
        part_strides = (0, 0, 0)
    else:
        part_strides = (part_lse.stride(0), part_lse.stride(1), part_lse.stride(2))
    use_softcap = softcap > 0.0
    qk_scale = scale if use_softcap else scale * LOG2_E
    dot_precision = "tf32x3" if q.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs
    paged_attention_kernel[grid](
        q, kv_cache, block_table, cu_seqlens_q, seq_lens, out, part_out, part_lse,
        num_seqs, layer * kv_cache.stride(1), qk_scale, float(softcap), int(sliding_window),
        plan.q_len_min, plan.q_len_max,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3), kv_cache.stride(4),
        block_table.stride(0), *part_strides,
        HEAD_DIM=head_dim, HEAD_DIM_P=tile.head_dim_padded, GROUP=num_q_heads // num_kv_heads,
        GROUP_P=tile.group_padded, BLOCK_Q=tile.block_q, BLOCK_N=tile.block_n, BLOCK_SIZE=block_size,
        NUM_SPLITS=splits, USE_WINDOW=sliding_window > 0, USE_SOFTCAP=use_softcap,
        DOT_PRECISION=dot_precision, num_warps=tile.num_warps, num_stages=tile.num_stages)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_table: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor,
                    sliding_window: int = 0, softcap: float = 0.0) -> None:
    """Write attention of q [T, Hq, D] over layer `layer` of the paged kv_cache into out [T, Hq, D].

    Inputs are validated by shadowprefill.ops (contiguous, consistent shapes, ids in range). The launches
    come from launch.plan_attention: shapes only, no device-to-host copy, so the call can be captured in
    a CUDA graph. sliding_window 0 and softcap 0.0 mean off.
    """
    from . import attention_split  # the reduce step of split launches

    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    _check_supported(kv_cache)
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[4]
    plans = launch.plan_attention(num_tokens, block_table.shape[0], head_dim, num_q_heads // num_kv_heads,
                                  num_kv_heads, block_table.shape[1] * block_size, q.dtype,
                                  launch.sm_count(q.device))
    for plan in plans:
        if plan.num_splits == 1:
            launch_attention(q, kv_cache, layer, block_table, cu_seqlens_q, seq_lens, scale, out,
                             sliding_window, softcap, plan)
        else:
            part_out, part_lse = attention_split.allocate_partials(q, plan.num_splits)
            launch_attention(q, kv_cache, layer, block_table, cu_seqlens_q, seq_lens, scale, out,
                             sliding_window, softcap, plan, part_out, part_lse)
            attention_split.reduce_splits(part_out, part_lse, out)


def _check_supported(kv_cache: torch.Tensor) -> None:
    head_dim = kv_cache.shape[5]
    if head_dim > 256:  # the tiles of launch.attention_tile stop fitting registers / shared memory
        raise ValueError(f"kv_cache: head_dim {head_dim} > 256 is not supported by the Triton kernels")
