"""The version gate: every vLLM internal the shadow scheduler relies on, checked at start-up.

vLLM's scheduler interface is not public, so a vLLM release may rename an attribute or change a signature
the plugin uses; unchecked, that surfaces as an `AttributeError` inside `schedule()` and kills the
EngineCore mid-run. `require()` checks all of them before the scheduler class is even defined (names of
modules, classes and enum members; methods with their parameters; instance attributes, found as class
members, dataclass fields or `self.<name> =` assignments in the class's source) and raises one
`VLLMVersionError` naming the supported range and everything missing. Outside `SUPPORTED` with nothing
missing it only warns. `python -m shadowprefill.integrations.vllm.compat` prints the report.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import logging
import re
import textwrap
from functools import lru_cache

logger = logging.getLogger("vllm.shadowprefill")

SUPPORTED = ">=0.31,<0.33"              # the `[vllm]` extra of pyproject.toml; suites ran on TESTED
TESTED = ("0.31.0", "0.32.0")

# module -> {object: [members]}; a member "name" must exist, "name(a, b)" must be callable with parameters
# a and b (in this order, others may sit between), "name -> text": the return annotation must contain text.
REQUIRED: dict[str, dict[str, list[str]]] = {
    "vllm.v1.core.sched.scheduler": {"Scheduler": [
        "__init__(vllm_config, kv_cache_config, structured_output_manager, block_size)",
        "schedule(throttle_prefills)", "update_from_output(scheduler_output, model_runner_output)",
        "add_request(request)", "_free_request(request, delay_free_blocks)", "_free_request_blocks(request)",
        "reset_prefix_cache(reset_running_requests, reset_connector)", "_preempt_request(request, timestamp)",
        "finish_requests(request_ids, finished_status)",
        "_make_cached_request_data(running_reqs, resumed_reqs, num_scheduled_tokens, spec_decode_tokens, "
        "req_to_new_blocks)", "_update_after_schedule(scheduler_output)", "shutdown()",
        "waiting", "running", "requests", "kv_cache_manager", "kv_holding_waiting", "block_size",
        "num_lookahead_tokens", "num_waiting_for_streaming_input", "model_uses_mrope", "max_num_scheduled_tokens",
        "max_num_running_reqs", "max_num_active_reqs", "finished_req_ids", "reset_preempted_req_ids",
        "prev_step_scheduled_req_ids", "use_pp", "scheduler_config", "policy", "num_spec_tokens",
        "num_prefill_lookahead", "needs_kv_cache_zeroing", "has_mamba_layers", "log_stats", "kv_cache_config",
        "ec_connector", "connector", "current_step", "cache_config", "_pause_state", "_inflight_prefills",
        "use_v2_model_runner",
        # the host tier (connector.py): the connector-meta hook, vLLM's async-load admission and free fence
        "_build_kv_connector_meta(connector, scheduler_output)", "_handle_blocked_waiting_request(request)",
        "_holds_kv_blocks(request)", "_inflight_prefill_reserved_blocks()", "connector_prefix_cache_stats",
        "defer_block_free", "sched_step_seq", "processed_step_seq"]},
    "vllm.v1.core.sched.async_scheduler": {"AsyncScheduler": ["_update_after_schedule(scheduler_output)"]},
    "vllm.v1.core.sched.interface": {"PauseState": ["UNPAUSED"]},
    "vllm.v1.core.sched.output": {
        "NewRequestData": ["from_request(request, block_ids, prefill_token_ids, uses_mrope)"],
        "SchedulerOutput": ["scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens",
                            "total_num_scheduled_tokens", "preempted_req_ids", "has_structured_output_requests",
                            "has_sync_kv_loads"],
        "CachedRequestData": ["req_ids", "resumed_req_ids", "new_token_ids", "all_token_ids", "new_block_ids",
                              "num_computed_tokens", "num_output_tokens"]},
    "vllm.v1.core.sched.request_queue": {"SchedulingPolicy": ["PRIORITY"],
                                         "RequestQueue": ["remove_requests(requests)", "prepend_requests(requests)"]},
    "vllm.v1.engine": {"EngineCoreEventType": ["SCHEDULED"],
                       "EngineCoreOutput": ["request_id", "new_token_ids", "finish_reason", "events", "trace_headers"],
                       "EngineCoreOutputs": ["outputs"]},
    "vllm.v1.kv_cache_interface": {"FullAttentionSpec": ["sliding_window"]},
    "vllm.v1.request": {
        "RequestStatus": ["WAITING", "PREEMPTED", "RUNNING", "FINISHED_ABORTED", "WAITING_FOR_REMOTE_KVS"],
        "Request": ["request_id", "priority", "status", "arrival_time", "num_computed_tokens", "num_tokens",
                    "num_prompt_tokens", "num_output_tokens", "num_preemptions", "prefill_stats",
                    "next_decode_eligible_step", "_all_token_ids", "lora_request", "mm_features",
                    "pooling_params", "use_structured_output", "prompt_embeds", "resumable", "sampling_params",
                    "client_index", "trace_headers", "record_event(event_type, timestamp)", "take_events()",
                    "get_finished_reason()"]},
    "vllm.v1.core.kv_cache_manager": {
        "KVCacheManager": ["allocate_slots(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, "
                           "num_lookahead_tokens, num_external_computed_tokens, delay_cache_blocks, "
                           "full_sequence_must_fit, reserved_blocks, has_scheduled_reqs)",
                           "truncate_computed_blocks(blocks, num_computed_tokens)",
                           "get_blocks(request_id)", "get_computed_blocks(request) -> tuple[KVCacheBlocks, int, int]",
                           "record_prefix_cache_stats(request, num_hits)", "block_pool", "watermark_blocks"],
        "KVCacheBlocks": ["blocks", "get_block_ids()"]},
    "vllm.v1.core.block_pool": {"BlockPool": ["free_block_queue", "get_num_free_blocks()",
                                              "evict_blocks(block_ids)", "blocks"]},
    "vllm.v1.core.kv_cache_utils": {
        "FreeKVCacheBlockQueue": ["fake_free_list_head", "fake_free_list_tail", "num_free_blocks",
                                  "remove(block)", "prepend_n(blocks)"],
        "KVCacheBlock": ["block_id", "block_hash", "ref_cnt", "prev_free_block", "next_free_block", "is_null"]},
    "vllm.v1.metrics.loggers": {"StatLoggerBase": ["record(scheduler_stats, iteration_stats)", "log()"]},
    "vllm.v1.metrics.stats": {"PrefixCacheStats": ["record(num_tokens, num_hits, preempted)"]},
    "vllm.distributed.kv_transfer.kv_connector.v1.base": {"KVConnectorBase_V1": [
        "get_num_new_matched_tokens(request, num_computed_tokens)",
        "update_state_after_alloc(request, blocks, num_external_tokens)"]},
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector": {"OffloadingConnector": []},
}


class VLLMVersionError(ImportError):
    """The installed vLLM lacks (or changed) internals the shadow scheduler uses."""


def vllm_version() -> str:
    try:
        import vllm
        return str(getattr(vllm, "__version__", "unknown"))
    except Exception as e:  # noqa: BLE001 - reported, not raised: the gate names what is missing
        return f"not importable ({type(e).__name__}: {e})"


def _in_range(version: str) -> bool:
    parts = []
    for p in version.split("+")[0].split(".")[:2]:
        if not p.isdigit():
            return False
        parts.append(int(p))
    return len(parts) == 2 and (0, 31) <= tuple(parts) < (0, 33)


@lru_cache(maxsize=None)
def _assigned(cls) -> frozenset:
    """Names assigned as `self.<name>` anywhere in the source of `cls` and its bases (not `object`)."""
    names: set[str] = set()
    for klass in cls.__mro__[:-1]:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                        names.add(sub.attr)
        names.update(getattr(klass, "__annotations__", {}))
    return frozenset(names)


def _check_member(obj, qual: str, spec: str) -> str | None:
    """None if `obj` has the member `spec` (see REQUIRED), else what is wrong."""
    spec, _, returns = (s.strip() for s in spec.partition("->"))
    name, _, params = spec.partition("(")
    where = f"{qual}.{name}"
    has = hasattr(obj, name) or (inspect.isclass(obj) and name in _assigned(obj))
    if not has:
        return f"{where} (missing)"
    if not params:
        return None
    fn = getattr(obj, name, None)
    if not callable(fn):
        return f"{where} (not callable)"
    want = [p.strip() for p in params.rstrip(")").split(",") if p.strip()]
    try:
        got = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None                      # builtins without a signature: the name is all we can check
    pos = 0
    for p in want:
        if p not in got[pos:]:
            return f"{where}({', '.join(want)}) (parameter {p!r} missing or moved; has ({', '.join(got)}))"
        pos = got.index(p, pos) + 1
    if returns:
        ann = inspect.signature(fn).return_annotation
        text = re.sub(r"\b\w+\.", "", ann if isinstance(ann, str) else str(ann))   # drop module paths
        if returns.replace(" ", "") not in text.replace(" ", "").replace("'", ""):
            return f"{where} returns {text}, expected {returns}"
    return None


def problems(required: dict | None = None) -> list[str]:
    """What the installed vLLM lacks of `required` (default REQUIRED), one line each."""
    out = []
    for module, objects in (REQUIRED if required is None else required).items():
        try:
            mod = importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - an import failure is one more missing internal
            out.append(f"{module} (cannot import: {type(e).__name__}: {e})")
            continue
        for name, members in objects.items():
            obj = getattr(mod, name, None)
            if obj is None:
                out.append(f"{module}.{name} (missing)")
                continue
            for m in members:
                bad = _check_member(obj, f"{module}.{name}", m)
                if bad:
                    out.append(bad)
    return out


def message(missing: list[str], version: str) -> str:
    return (f"shadowprefill's ShadowScheduler supports vLLM {SUPPORTED} (tested: {', '.join(TESTED)}); the "
            f"installed vLLM {version} lacks or changed {len(missing)} internal(s) it uses: " + "; ".join(missing)
            + ". Install a supported vLLM: pip install 'shadowprefill[vllm]'.")


def require(required: dict | None = None) -> str:
    """Check every internal at start-up; raise VLLMVersionError with one message if any is missing.
    Returns the vLLM version."""
    version = vllm_version()
    missing = problems(required)
    if missing:
        raise VLLMVersionError(message(missing, version))
    if not _in_range(version):
        logger.warning("ShadowScheduler: vLLM %s is outside the supported range %s; every internal the plugin "
                       "uses is present, so it starts", version, SUPPORTED)
    return version


if __name__ == "__main__":
    v, bad = vllm_version(), problems()
    print(message(bad, v) if bad else f"vLLM {v}: every internal ShadowScheduler uses is present "
                                        f"(supported {SUPPORTED}, in range: {_in_range(v)})")
