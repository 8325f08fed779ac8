"""Prometheus text exposition: the few lines the engine server writes and the manager reads.

The built-in engine server exports the metric names vLLM exports (`vllm:num_requests_waiting`,
`vllm:num_requests_running`, `vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total`,
`vllm:cache_config_info{block_size=...}`), so the manager reads a vLLM server and a built-in one the same
way. Parsing sums a metric over its label sets (a vLLM server with several engine cores exports one series
per core).
"""
from __future__ import annotations

import math
import re

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
CACHE_CONFIG = "vllm:cache_config_info"


def format_metric(name: str, value: float, kind: str = "gauge", help_text: str = "",
                  labels: dict[str, str] | None = None) -> str:
    """One metric family with one sample, as Prometheus text."""
    label_text = ""
    if labels:
        label_text = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
    return f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n{name}{label_text} {float(value)}\n"


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """name -> [(labels, value)] for every sample line of a Prometheus text page."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        out.setdefault(m.group(1), []).append((labels, value))
    return out


def metric_sum(parsed: dict, name: str, default: float = math.nan) -> float:
    """Sum of a metric over its series (`default` when absent)."""
    series = parsed.get(name)
    return default if not series else float(sum(v for _, v in series))


def block_size_of(parsed: dict) -> int | None:
    """The server's KV block size from `vllm:cache_config_info{block_size="..."}`, if exported."""
    for labels, _ in parsed.get(CACHE_CONFIG, []):
        if labels.get("block_size", "").isdigit():
            return int(labels["block_size"])
    return None
