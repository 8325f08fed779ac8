"""Executors: run one scheduled iteration (DESIGN.md §5).

`ModelExecutor` runs the real forward pass (write_kv + paged_attention per layer) over the paged KV
cache and samples greedily; which rows sample is the scheduler's decision (`batch.samples`).
`SimulatedExecutor` runs nothing: it asks a latency model how long the iteration would take, so the
simulator drives the very same scheduler, pool and controller on a virtual clock. Both return the
iteration's duration in seconds and the tokens sampled for `batch.samples` (in that order), or None when
no token is sampled: each request then takes its next known token (its replay, then its `fill_token`,
the executor's `fill_token`), which the scheduler counts instead of storing.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from shadowprefill.kv.reload import ReloadBatch
from shadowprefill.model.forward_batch import ForwardBatch


@dataclass
class ExecuteResult:
    tokens: list[int] | None  # one per batch.samples entry; None: each request's next known token
    duration: float         # seconds the iteration took (measured, or predicted by the latency model)


class Executor:
    """Interface: `execute(batch) -> ExecuteResult`; `kv_cache` is None when nothing is computed.
    `fill_token`: not None for an executor that samples nothing (its ExecuteResult.tokens is None): the
    value of a request's output tokens past its replay."""

    kv_cache: torch.Tensor | None = None
    fill_token: int | None = None

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
        sample are the scheduler's (`batch.samples`: decodes and the prefills with `samples_now`); the
        layer-wise reloads its pages wait for (`kv_ready`, see `reload_waits`)."""
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
        return ForwardBatch.from_sequences(feeds, cached, tables, self.block_size, logits=logits, device=self.device,
                                           kv_ready=self.reload_waits(batch))

    @staticmethod
    def reload_waits(batch) -> tuple:
        """The side-stream copies the iteration's pages depend on, each once: layer-wise host-tier reloads
        (ReloadBatch) are returned, for the forward to wait on layer l just before layer l's attention; any
        other copy (a spill still reading a page hit meanwhile: a CUDA event) is waited on here, before
        layer 0. The compute stream waits, never the host (on CPU the copies run in order when waited on)."""
        events = {id(e): e for e in [r.ready_event for r, _ in batch.prefills] if e is not None}
        for r, _ in batch.prefills:
            r.ready_event = None
        layered = []
        for ev in events.values():
            if isinstance(ev, ReloadBatch):
                layered.append(ev)
            elif hasattr(ev, "wait"):
                ev.wait()                         # torch.cuda.Event: current stream waits, host does not
        return tuple(layered)

    def execute(self, batch) -> ExecuteResult:
        start = time.perf_counter()
        fb = self.forward_batch(batch)
        logits = self.model.forward(fb, self.kv_cache)
        tokens = logits.argmax(dim=-1).tolist() if logits.shape[0] else []   # greedy; tolist() syncs
        if len(tokens) != len(batch.samples):
            raise RuntimeError(f"model returned {len(tokens)} logits rows for {len(batch.samples)} samples")
        return ExecuteResult(tokens, time.perf_counter() - start)


class SimulatedExecutor(Executor):
    """No tensors: the iteration's duration comes from `latency_model.iteration_time(prefill,
    decode_contexts)` (prefill chunks, shadow chunks included, as (new_tokens, cached_before); decodes as
    context lengths). If the latency model also has `overlapped_time(compute_s, reload_tokens, head_start_s)`
    and `reload_time(tokens)`, host-tier reloads are charged as the layer-wise reload the real forward runs:
    the iteration's reloads (`batch.reload_tokens`: its admissions' and shadow chunks') pipelined with its
    compute, after whatever the side stream still copies; the reloads issued one iteration ahead
    (`batch.ahead_tokens`) run behind them and are waited on by the iteration that admits their requests
    (`batch.prefetched_tokens`). Sampled tokens are `token_fn(request)`; without a token_fn nothing is
    sampled (tokens None) and every output token past a replayed one is `filler_token` (`fill_token`),
    counted by the scheduler, never stored one by one."""

    kv_cache = None

    def __init__(self, latency_model, token_fn: Callable | None = None, filler_token: int = 0) -> None:
        if not callable(getattr(latency_model, "iteration_time", None)):
            raise TypeError("latency_model must have an iteration_time(prefill, decode_contexts) method")
        self.latency_model = latency_model
        if token_fn is None and (isinstance(filler_token, bool) or not isinstance(filler_token, int)
                                 or filler_token < 0):
            raise ValueError(f"filler_token must be an int >= 0, got {filler_token!r}")
        self.token_fn = token_fn
        self.filler_token = filler_token
        self.fill_token = filler_token if token_fn is None else None
        self._overlap = getattr(latency_model, "overlapped_time", None)
        self._reload = getattr(latency_model, "reload_time", None)
        self._side_free = -math.inf   # (virtual) time the side stream finishes the copies issued so far
        self._ahead = None            # (start, tokens) of the reloads issued one iteration ahead

    def execute(self, batch) -> ExecuteResult:
        duration = float(self.latency_model.iteration_time(*batch.shape()))
        if self._overlap is not None and self._reload is not None:
            if batch.reload_tokens or batch.prefetched_tokens or batch.ahead_tokens:
                duration = self._with_reloads(batch, duration)
            else:                                # no copies: reloads issued ahead and not waited on lapse
                self._ahead = None               # (the side stream's timeline is read as max(now, free))
        fn = self.token_fn
        if fn is None:
            return ExecuteResult(None, duration)
        tokens = list(map(fn, batch.samples))
        if not {*map(type, tokens)} <= {int}:    # convert only what is not a plain int already
            tokens = [int(t) for t in tokens]
        return ExecuteResult(tokens, duration)

    def _with_reloads(self, batch, compute: float) -> float:
        """The iteration's duration with its reloads overlapped (latency.pipelined_reload_s), and the side
        stream's timeline: this iteration's reloads first, then those issued ahead for the next one."""
        now, overlap = batch.now, self._overlap
        side = max(now, self._side_free)
        duration = compute
        if batch.reload_tokens:
            duration = float(overlap(compute, batch.reload_tokens, now - side))
            side += float(self._reload(batch.reload_tokens))
        if batch.prefetched_tokens and self._ahead is not None:   # admissions whose reload was issued ahead
            start, tokens = self._ahead
            duration = max(duration, float(overlap(compute, tokens, now - start)))
        self._ahead = None
        if batch.ahead_tokens:
            self._ahead = (side, batch.ahead_tokens)
            side += float(self._reload(batch.ahead_tokens))
        self._side_free = side
        return duration
