"""Executors: run one scheduled iteration (DESIGN.md §5).

`ModelExecutor` runs the real forward pass (write_kv + paged_attention per layer) over the paged KV
cache and samples greedily. `SimulatedExecutor` runs nothing: it asks a latency model how long the
iteration would take, so the simulator drives the very same scheduler, pool and controller on a
virtual clock. Both return the tokens sampled for `batch.samples` (in that order) and the iteration's
duration in seconds.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from shadowprefill.model.forward_batch import ForwardBatch


@dataclass
class ExecuteResult:
    tokens: list[int]       # one per batch.samples entry
    duration: float         # seconds the iteration took (measured, or predicted by the latency model)


class Executor:
    """Interface: `execute(batch) -> ExecuteResult`; `kv_cache` is None when nothing is computed."""

    kv_cache: torch.Tensor | None = None

    def execute(self, batch) -> ExecuteResult:
        raise NotImplementedError


class ModelExecutor(Executor):
    """Real forward of `model` over `kv_cache`, greedy sampling. Sequence order in the forward batch:
    decodes, prefill chunks, shadow chunks (which request no logits)."""

    def __init__(self, model, kv_cache: torch.Tensor) -> None:
        if not callable(getattr(model, "forward", None)):
            raise TypeError(f"model must have forward(batch, kv_cache), got {type(model).__name__}")
        if not isinstance(kv_cache, torch.Tensor):
            raise TypeError(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.shape[4]
        self.device = kv_cache.device

    def build_forward_batch(self, batch) -> ForwardBatch:
        """The ForwardBatch of a scheduled iteration."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logits_rows: list[int] = []

        def add(tokens: list[int], start: int, table: list[int], sample: bool) -> None:
            end = start + len(tokens)
            input_ids.extend(tokens)
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            cu.append(cu[-1] + len(tokens))
            seq_lens.append(end)
            tables.append(table)
            if sample:
                logits_rows.append(cu[-1] - 1)

        for r in batch.decodes:
            c = r.num_computed_tokens
            add(r.all_token_ids[c:c + 1], c, r.block_ids, True)
        for r, n in batch.prefills:
            c = r.num_computed_tokens
            add(r.all_token_ids[c:c + n], c, r.block_ids, n == r.num_remaining and not r.prefill_only)
        for chunk in batch.shadow_chunks:
            add(chunk.new_token_ids, chunk.start, chunk.block_ids, False)

        width = max(1, max(len(t) for t in tables))
        table = torch.zeros((len(tables), width), dtype=torch.int32)   # padding page 0 is never read
        for i, t in enumerate(tables):
            table[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        dev = self.device

        def tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(dev)

        return ForwardBatch(input_ids=tensor(input_ids, torch.int64), positions=tensor(positions, torch.int64),
                            slot_mapping=tensor(slots, torch.int64), block_table=table.to(dev),
                            cu_seqlens_q=tensor(cu, torch.int32), seq_lens=tensor(seq_lens, torch.int32),
                            logits_indices=tensor(logits_rows, torch.int64))

    def _wait_for_reloads(self, batch) -> None:
        """Host-tier reloads run on a side stream: the compute stream waits on their events."""
        events = [r.ready_event for r, _ in batch.prefills if r.ready_event is not None]
        events += [c.ready_event for c in batch.shadow_chunks if c.ready_event is not None]
        for ev in events:
            if hasattr(ev, "wait"):
                ev.wait()                         # torch.cuda.Event: current stream waits, host does not
        for r, _ in batch.prefills:
            r.ready_event = None

    def execute(self, batch) -> ExecuteResult:
        start = time.perf_counter()
        self._wait_for_reloads(batch)
        fb = self.build_forward_batch(batch)
        logits = self.model.forward(fb, self.kv_cache)
        tokens = logits.argmax(dim=-1).tolist() if logits.shape[0] else []   # greedy; tolist() syncs
        if len(tokens) != len(batch.samples):
            raise RuntimeError(f"model returned {len(tokens)} logits rows for {len(batch.samples)} samples")
        return ExecuteResult(tokens, time.perf_counter() - start)


class SimulatedExecutor(Executor):
    """No tensors: the iteration's duration comes from `latency_model.iteration_time(prefill,
    decode_contexts)` (prefill chunks, shadow chunks included, as (new_tokens, cached_before); decodes as
    context lengths). If the latency model also has `reload_time(num_tokens)`, the host-tier reloads of
    the iteration's admissions and shadow chunks are added to it. Sampled tokens are `token_fn(request)`
    (default: token id 0)."""

    kv_cache = None

    def __init__(self, latency_model, token_fn: Callable | None = None) -> None:
        if not callable(getattr(latency_model, "iteration_time", None)):
            raise TypeError("latency_model must have an iteration_time(prefill, decode_contexts) method")
        self.latency_model = latency_model
        self.token_fn = token_fn
        self._reload = getattr(latency_model, "reload_time", None)

    def execute(self, batch) -> ExecuteResult:
        duration = float(self.latency_model.iteration_time(batch.prefill_list(), batch.decode_contexts()))
        if self._reload is not None and batch.reload_tokens:
            duration += float(self._reload(batch.reload_tokens))
        fn = self.token_fn
        if fn is None:
            return ExecuteResult([0] * len(batch.samples), duration)
        tokens = list(map(fn, batch.samples))
        if not {*map(type, tokens)} <= {int}:    # convert only what is not a plain int already
            tokens = [int(t) for t in tokens]
        return ExecuteResult(tokens, duration)
