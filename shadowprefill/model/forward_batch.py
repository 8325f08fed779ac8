"""The flattened variable-length batch one model forward consumes.

All new tokens of all sequences of an iteration (prefill chunks, decodes, shadow chunks) are concatenated
into one row dimension T. Sequence s owns rows cu_seqlens_q[s]:cu_seqlens_q[s+1]; its K/V pages are listed
in block_table[s]; seq_lens[s] = tokens already cached + its new tokens (DESIGN.md §4).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

_DTYPES = {
    "input_ids": torch.int64,
    "positions": torch.int64,
    "slot_mapping": torch.int64,
    "block_table": torch.int32,
    "cu_seqlens_q": torch.int32,
    "seq_lens": torch.int32,
    "logits_indices": torch.int64,
}


@dataclass
class ForwardBatch:
    """Inputs of `Llama.forward`.

    input_ids [T] int64, positions [T] int64 (absolute position of each new token), slot_mapping [T]
    int64 (block_id * block_size + offset where the token's K/V is written; negative = skip),
    block_table [S, max_blocks] int32, cu_seqlens_q [S+1] int32, seq_lens [S] int32, logits_indices [n]
    int64 (rows of T whose logits are returned, in this order). kv_ready: copies the forward waits on
    layer by layer, objects with `wait(layer)` (kv.reload.ReloadBatch: a layer-wise host-tier reload); the
    forward calls wait(l) on each just before layer l writes or reads the cache.

    Construction checks shapes, dtypes and devices (no device sync). `from_sequences` builds a batch from
    Python lists and also checks the values.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    logits_indices: torch.Tensor
    kv_ready: tuple = ()

    def __post_init__(self) -> None:
        for name, dtype in _DTYPES.items():
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"ForwardBatch.{name} must be a torch.Tensor, got {type(value).__name__}")
            if value.dtype != dtype:
                raise TypeError(f"ForwardBatch.{name} must be {dtype}, got {value.dtype}")
            if value.device != self.input_ids.device:
                raise ValueError(f"ForwardBatch.{name} is on {value.device}, input_ids on "
                                 f"{self.input_ids.device}")
            want_dim = 2 if name == "block_table" else 1
            if value.dim() != want_dim:
                raise ValueError(f"ForwardBatch.{name} must be {want_dim}-D, got shape {tuple(value.shape)}")
        num_tokens = self.input_ids.shape[0]
        for name in ("positions", "slot_mapping"):
            if getattr(self, name).shape[0] != num_tokens:
                raise ValueError(f"ForwardBatch.{name} has {getattr(self, name).shape[0]} rows, input_ids "
                                 f"has {num_tokens}")
        num_seqs = self.seq_lens.shape[0]
        if self.block_table.shape[0] != num_seqs:
            raise ValueError(f"ForwardBatch.block_table has {self.block_table.shape[0]} rows, seq_lens has "
                             f"{num_seqs}")
        if self.cu_seqlens_q.shape[0] != num_seqs + 1:
            raise ValueError(f"ForwardBatch.cu_seqlens_q must have {num_seqs + 1} entries, got "
                             f"{self.cu_seqlens_q.shape[0]}")

    @property
    def num_tokens(self) -> int:
        """T: new tokens in the batch."""
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        """S: sequences in the batch."""
        return self.seq_lens.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "ForwardBatch":
        """A copy with every tensor on `device`."""
        return ForwardBatch(**{name: getattr(self, name).to(device, non_blocking=non_blocking)
                               for name in _DTYPES}, kv_ready=self.kv_ready)

    @classmethod
    def from_sequences(cls, new_token_ids: Sequence[Sequence[int]], num_cached: Sequence[int],
                       block_tables: Sequence[Sequence[int]], block_size: int,
                       logits: str | Sequence[bool] = "last", device: torch.device | str = "cpu",
                       vocab_size: int | None = None, max_position: int | None = None,
                       kv_ready: tuple = ()) -> "ForwardBatch":
        """Build a batch from per-sequence lists.

        new_token_ids[s]: the tokens sequence s feeds this step (a prefill chunk, or one decode token);
        num_cached[s]: tokens of s whose K/V is already in its pages; block_tables[s]: its page ids, which
        must cover num_cached[s] + len(new_token_ids[s]) tokens. `logits`: "last" (last new token of every
        sequence), "all" (every row), "none", or one bool per sequence (its last new token or nothing).
        `vocab_size` / `max_position`, when given, bound the token ids / positions. `kv_ready`: see the class.
        """
        num_seqs = len(new_token_ids)
        if len(num_cached) != num_seqs or len(block_tables) != num_seqs:
            raise ValueError(f"new_token_ids, num_cached and block_tables must have one entry per sequence, "
                             f"got {num_seqs}, {len(num_cached)}, {len(block_tables)}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if isinstance(logits, str):
            if logits not in ("last", "all", "none"):
                raise ValueError(f"logits must be 'last', 'all', 'none' or a list of bools, got {logits!r}")
        elif len(logits) != num_seqs:
            raise ValueError(f"logits has {len(logits)} entries, expected one per sequence ({num_seqs})")

        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_seqlens = [0]
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        for s in range(num_seqs):
            tokens, cached, table = list(new_token_ids[s]), num_cached[s], block_tables[s]
            if not tokens:
                raise ValueError(f"new_token_ids[{s}] is empty; every sequence needs at least one new token")
            if cached < 0:
                raise ValueError(f"num_cached[{s}] must be >= 0, got {cached}")
            total = cached + len(tokens)
            if len(table) * block_size < total:
                raise ValueError(f"block_tables[{s}] has {len(table)} pages of {block_size} tokens, too few "
                                 f"for {total} tokens")
            if max_position is not None and total > max_position:
                raise ValueError(f"sequence {s} reaches position {total - 1} >= max_position {max_position}")
            if vocab_size is not None and any(t < 0 or t >= vocab_size for t in tokens):
                raise ValueError(f"new_token_ids[{s}] holds a token id outside [0, {vocab_size})")
            for pos in range(cached, total):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
            positions.extend(range(cached, total))
            input_ids.extend(tokens)
            start = cu_seqlens[-1]
            cu_seqlens.append(start + len(tokens))
            seq_lens.append(total)
            if logits == "all":
                logits_rows.extend(range(start, start + len(tokens)))
            elif logits == "last" or (not isinstance(logits, str) and logits[s]):
                logits_rows.append(start + len(tokens) - 1)

        max_blocks = max((len(t) for t in block_tables), default=0)
        max_blocks = max(max_blocks, 1)
        table_rows = [list(t) + [0] * (max_blocks - len(t)) for t in block_tables]  # pad with page 0: never read
        if any(b < 0 for row in table_rows for b in row):
            raise ValueError("block_tables holds a negative page id")

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device)

        return cls(
            input_ids=tensor(input_ids, torch.int64),
            positions=tensor(positions, torch.int64),
            slot_mapping=tensor(slots, torch.int64),
            block_table=(torch.tensor(table_rows, dtype=torch.int32).to(device) if num_seqs
                         else torch.zeros((0, 1), dtype=torch.int32, device=device)),
            cu_seqlens_q=tensor(cu_seqlens, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            logits_indices=tensor(logits_rows, torch.int64),
            kv_ready=tuple(kv_ready),
        )
