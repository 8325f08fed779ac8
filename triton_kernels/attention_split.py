"""Split-KV ("flash-decoding") reduce: merge the per-split partial results of paged_attention_kernel.

When a batch has too few query tiles to fill the GPU (a few decodes over long contexts) the attention
kernel runs split (SPLIT): program (tile, kv_head, split) attends to one contiguous share of the keys
and writes o_s (normalised by its own softmax sum l_s) and lse_s = m_s + log2(l_s). The exact result is
    out = sum_s w_s * o_s / sum_s w_s,   w_s = 2^(lse_s - max_s lse_s)
(splits that saw no key have lse_s = -inf, so w_s = 0).
part_lse starts at -inf: rows whose sequence belongs to the other launch of a mixed batch (or to no
sequence) are never written by the attention kernel, and the reduce leaves their output untouched.
"""
import torch
import triton
import triton.language as tl

from . import launch


@triton.jit
def reduce_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh, num_splits,
                         SPLITS_P: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    offs_s = tl.arange(0, SPLITS_P)
    offs_d = tl.arange(0, HEAD_DIM_P)
    s_ok = offs_s < num_splits
    row = (token * num_heads + head) * num_splits  # part_lse [T, Hq, NUM_SPLITS], part_out [..., D]
    lse = tl.load(part_lse_ptr + row + offs_s, mask=s_ok, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    if lse_max == float("-inf"):
        return  # a row of the other launch (a real row always sees its own key): leave it alone
    weight = tl.exp2(lse - lse_max)
    mask = s_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    parts = tl.load(part_out_ptr + (row + offs_s)[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0)
    total = tl.sum(weight, 0)
    o = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def allocate_partials(q: torch.Tensor, num_splits: int):
    """Scratch for a split launch: part_out [T, Hq, splits, D] and part_lse [T, Hq, splits], float32.

    The attention kernel writes every (token, head, split) entry of the sequences its launch takes (empty
    splits write lse = -inf); part_lse starts at -inf so that the reduce can tell the rows it did not take.
    """
    num_tokens, num_heads, head_dim = q.shape
    part_out = torch.empty((num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.full((num_tokens, num_heads, num_splits), float("-inf"), dtype=torch.float32, device=q.device)
    return part_out, part_lse


def reduce_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> None:
    """out[t, h] = the log-sum-exp weighted merge of part_out[t, h, :] (enqueued, no host sync)."""
    num_tokens, num_heads, num_splits, head_dim = part_out.shape
    reduce_splits_kernel[(num_tokens, num_heads)](
        part_out, part_lse, out, out.stride(0), out.stride(1), num_splits,
        SPLITS_P=max(2, launch.next_power_of_2(num_splits)),
        HEAD_DIM=head_dim, HEAD_DIM_P=max(16, launch.next_power_of_2(head_dim)), num_warps=4)
