"""Executors: run one scheduled iteration (DESIGN.md §5).

`ModelExecutor` runs the real forward pass (write_kv + paged_attention per layer) over the paged KV
cache and samples greedily; which rows sample is the scheduler's decision (`batch.samples`). `SimulatedExecutor` runs nothing: it asks a latency model how long the
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

    def forward_batch(self, batch) -> ForwardBatch:
        """The ForwardBatch of a scheduled iteration: decodes, prefill chunks, shadow chunks; the rows that
        sample are the scheduler's (`batch.samples`: decodes and the prefills with `samples_now`)."""
        feeds, cached, tables, logits = [], [], [], []
        for r in batch.decodes:
            c = r.num_computed_tokens
            feeds.append(r.all_token_ids[c:c + 1])
            cached.append(c)
            tables.append(r.block_ids)
            logits.append(True)
        for r, n in batch.prefills:
            c = r.num_computed_tokens
            feeds.append(r.all_token_ids[c:c + n])
            cached.append(c)
            tables.append(r.block_ids)
            logits.append(r.samples_now)
        for chunk in batch.shadow_chunks:
            feeds.append(chunk.new_token_ids)
            cached.append(chunk.start)
            tables.append(chunk.block_ids)
            logits.append(False)
        return ForwardBatch.from_sequences(feeds, cached, tables, self.block_size, logits=logits, device=self.device)

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
        fb = self.forward_batch(batch)
        logits = self.model.forward(fb, self.kv_cache)
        tokens = logits.argmax(dim=-1).tolist() if logits.shape[0] else []   # greedy; tolist() syncs
        if len(tokens) != len(batch.samples):
            raise RuntimeError(f"model returned {len(tokens)} logits rows for {len(batch.samples)} samples")
        return ExecuteResult(tokens, time.perf_counter() - start)


class SimulatedExecutor(Executor):
    """No tensors: the iteration's duration comes from `latency_model.iteration_time(prefill,
    decode_contexts)` (prefill chunks, shadow chunks included, as (new_tokens, cached_before); decodes as
    context lengths). If the latency model also has `reload_time(num_tokens)`, the host-tier reloads of
    the iteration's admissions and shadow chunks are added to it. Sampled tokens are `token_fn(request)`,
    or `filler_token` for every sample (requests that replay a recorded output take theirs instead)."""

    kv_cache = None

    def __init__(self, latency_model, token_fn: Callable | None = None, filler_token: int = 0) -> None:
        if not callable(getattr(latency_model, "iteration_time", None)):
            raise TypeError("latency_model must have an iteration_time(prefill, decode_contexts) method")
        self.latency_model = latency_model
        self.token_fn = token_fn
        self.filler_token = filler_token
        self._reload = getattr(latency_model, "reload_time", None)

    def execute(self, batch) -> ExecuteResult:
        duration = float(self.latency_model.iteration_time(*batch.shape()))
        if self._reload is not None and batch.reload_tokens:
            duration += float(self._reload(batch.reload_tokens))
        fn = self.token_fn
        if fn is None:
            return ExecuteResult([self.filler_token] * len(batch.samples), duration)
        tokens = list(map(fn, batch.samples))
        if not {*map(type, tokens)} <= {int}:    # convert only what is not a plain int already
            tokens = [int(t) for t in tokens]
        return ExecuteResult(tokens, duration)
