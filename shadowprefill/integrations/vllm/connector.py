"""Shadow prefill with vLLM's host tier: `ShadowScheduler` under a KV connector (`OffloadingConnector`).

    vllm serve MODEL --scheduler-cls shadowprefill.integrations.vllm.ShadowScheduler \\
        --scheduling-policy priority --enable-prefix-caching \\
        --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                               "kv_connector_extra_config": {"cpu_bytes_to_use": 8000000000}}'

vLLM builds the connector's metadata (which blocks to store to / load from the host) at the end of
`Scheduler.schedule()`, from the step's `SchedulerOutput`, before it advances the requests' computed
tokens. Shadow chunks must be in that output by then, or the connector never stores the blocks they compute
(and it reads `num_computed_tokens + num_scheduled_tokens` of every scheduled request). So with a connector
the plugin's shadow phase runs inside vLLM's `_build_kv_connector_meta` hook (`ShadowScheduler
._build_kv_connector_meta`), and vLLM's own `_update_after_schedule` then advances shadows with everything
else. A waiting shadow is admitted the way vLLM admits any request (paper §3.3: shadow work reuses the
cached prefix, here from both tiers): the local prefix-cache hit, then the connector's lookup
(`get_num_new_matched_tokens`), then `update_state_after_alloc` after the allocation. When the connector
loads asynchronously (OffloadingConnector always does), the shadow holds its blocks in
`WAITING_FOR_REMOTE_KVS` and computes nothing that step; once the worker reports the load, the shadow's
remaining prompt runs in budgeted chunks as usual. A load costs the step no compute (it runs on the
connector's copy stream between steps); its blocks count against the shadow KV cap.

Which connectors: `OffloadingConnector` only (its scheduler side is exercised in the model-free
conformance harness; its CUDA worker is untested here, see docs/vllm-plugin.md). Other connectors are
refused at start-up: P/D connectors push or pull KV of requests another engine schedules, which a
budgeted, preemptible shadow class was not built for.
"""
from __future__ import annotations

import inspect
import time

from vllm.v1.metrics import stats as _vllm_stats
from vllm.v1.request import RequestStatus

SUPPORTED_CONNECTORS = ("OffloadingConnector",)


def connector_problem(sched) -> str | None:
    """Why the scheduler's KV connector cannot run with shadows (None: it can, or there is none)."""
    conn = sched.connector
    if conn is None:
        return None
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    if type(conn) is not OffloadingConnector:   # a subclass or a MultiConnector may move or push KV elsewhere
        return (f"supports the KV connector {', '.join(SUPPORTED_CONNECTORS)} only (vLLM's host tier), not "
                f"{type(conn).__name__}")
    return None


class ConnectorAdmission:
    """vLLM's waiting-queue admission of one request under a connector, for shadow requests (the steps of
    `Scheduler.schedule`'s waiting loop that a text-only, full-attention request goes through)."""

    def __init__(self, sched) -> None:
        self.s = sched
        self.conn = sched.connector
        alloc = inspect.signature(sched.kv_cache_manager.allocate_slots).parameters
        self._skip_zeroing = "skip_zeroing_group_ids" in alloc                     # vLLM 0.32
        stats = sched.connector_prefix_cache_stats
        self._by_source = stats is not None and "hits_by_source" in inspect.signature(stats.record).parameters \
            and hasattr(self.conn, "get_external_cache_hit_sources")                  # vLLM 0.32

    def lookup(self, r):
        """Local prefix hit, then the connector's: (computed blocks, local tokens, external tokens, async)
        or None when the connector cannot tell yet (vLLM skips the request this step too)."""
        s, bs = self.s, self.s.block_size
        computed, local, _ = s.kv_cache_manager.get_computed_blocks(r)
        tail = local % bs                       # present a block-aligned local hit (vLLM does the same)
        ext, load_async = self.conn.get_num_new_matched_tokens(r, local - tail)
        if getattr(r, "skip_reading_prefix_cache", False):
            ext, load_async = 0, False
        if ext is None:
            return None
        if tail and ext > tail:                 # the connector's hit supersedes the local sub-block tail
            computed = s.kv_cache_manager.truncate_computed_blocks(computed, local - tail)
            local -= tail
        elif tail:
            ext, load_async = 0, False
        return computed, local, ext, bool(load_async and ext > 0)

    def after_alloc(self, r, local: int, ext: int) -> None:
        """What vLLM does right after a waiting request's allocation: tell the connector, count its hits."""
        s = self.s
        self.conn.update_state_after_alloc(r, s.kv_cache_manager.get_blocks(r.request_id), ext)
        stats = s.connector_prefix_cache_stats
        queries = r.num_tokens - local
        if stats is not None and queries:
            preempted = r.num_preemptions > 0
            kw = {}
            if self._by_source:
                kw["hits_by_source"] = (self.conn.get_external_cache_hit_sources(r, ext)
                                        if ext and not preempted else None)
            stats.record(num_tokens=queries, num_hits=ext, preempted=preempted, **kw)

    def start_load(self, r, computed, local: int, ext: int) -> bool:
        """Admit `r` for an asynchronous load of `ext` tokens after its `local` hit (vLLM's load_kv_async
        path): allocate its blocks, hand them to the connector, park it in WAITING_FOR_REMOTE_KVS. False:
        no room (nothing held)."""
        s, kvm = self.s, self.s.kv_cache_manager
        kw = {"skip_zeroing_group_ids": self.conn.get_loaded_kv_cache_group_ids(r)} if self._skip_zeroing and \
            hasattr(self.conn, "get_loaded_kv_cache_group_ids") else {}
        blocks = kvm.allocate_slots(r, 0, num_new_computed_tokens=local, new_computed_blocks=computed,
                                    num_lookahead_tokens=0, num_external_computed_tokens=ext, delay_cache_blocks=True,
                                    full_sequence_must_fit=False, reserved_blocks=s._inflight_prefill_reserved_blocks(),
                                    has_scheduled_reqs=True, **kw)
        if blocks is None:
            return False
        if r.prefill_stats and r.num_preemptions <= 0:
            r.prefill_stats.set(num_prompt_tokens=r.num_prompt_tokens, num_local_cached_tokens=local,
                                num_external_cached_tokens=ext)
        self.after_alloc(r, local, ext)
        kvm.record_prefix_cache_stats(r, local)
        r.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        r.num_computed_tokens = local + ext     # vLLM's convention: set now, corrected if the load fails
        s._inflight_prefills.add(r)
        deferred = getattr(s, "deferred_waiting", None)
        if deferred is not None:
            deferred.add(r)
        self.fetch_stage(r, getattr(_vllm_stats, "KV_FETCH_IN_PROGRESS", None))
        return True

    def fetch_stage(self, r, stage) -> None:
        """vLLM 0.32's KV-fetch stage gauge (`vllm.v1.metrics.stats.KV_FETCH_*`); absent in 0.31."""
        fn = getattr(self.s, "_set_kv_fetch_stage", None)
        if fn is not None and (stage is not None or r in (getattr(self.s, "_kv_fetch_stages", None) or ())):
            fn(r, stage)

    @staticmethod
    def ready(sched, r) -> bool:
        """A shadow parked for a load: True once the worker reported it (vLLM moves it back to WAITING or
        PREEMPTED with the loaded tokens computed, or with none if the load failed)."""
        return r.status != RequestStatus.WAITING_FOR_REMOTE_KVS or sched._handle_blocked_waiting_request(r)


class DeferredShadowFrees:
    """With a connector and async scheduling vLLM defers freeing a finished request's blocks until the step
    that may still write them is processed (`defer_block_free`); the evict-first placement of a shadow's
    blocks (§3.3) then waits for the same fence."""

    def __init__(self) -> None:
        self.pending: list[tuple[int, list]] = []

    def add(self, fence: int, blocks) -> None:
        self.pending.append((fence, list(blocks)))

    def drain(self, processed: int, kv) -> None:
        if not self.pending:
            return
        now, keep = time.monotonic(), []
        for fence, blocks in self.pending:
            if fence <= processed:
                kv.note_freed(blocks, now)
                kv.place_freed(blocks, now)
            else:
                keep.append((fence, blocks))
        self.pending = keep
