"""Per-step statistics of the vLLM shadow scheduler: one JSON object per line (`stats_path`).

Each line describes one executed scheduler step: `step`, `t` (wall-clock seconds when it was scheduled),
`duration_s` (schedule to end of output processing), `predicted_s` (t̂ of the batch, shadow chunks included,
as the budget saw it), `shadow_s` (the part of it the shadow chunks add), `branch` (Algorithm 1:
blocked / idle / credit / slo), `budget_s` (b), `budget_tokens` (the most shadow tokens the step allowed),
`shadow_tokens`, `shadow_chunks`, `shadow_blocks` (held or cached by shadow work), `shadow_cap_blocks`,
`num_blocks`, `free_blocks`, `waiting` (non-shadow requests waiting), `running`, `decodes`, `prefill_tokens`
(non-shadow), `shadow_pending`, cumulative `shadow_preempted`, `shadow_evicted_blocks`,
`shadow_promoted_blocks`, `tpot_slo_s`, `credit_s`, `warm` (T fixed and t̂ measured on enough prefill steps),
and t̂'s guardrails: `budget_scale` (feedback shrink of b after an overrun), `chunk_limit` (the most shadow
tokens a step may take: n_min until warm, then 2x the largest measured prefill step), cumulative `overruns`
(shadow-carrying steps measured past 1.5x their bound), cumulative `shadow_superseded` (shadows a routed call
of their session superseded) and `shadow_refused` (shadows larger than the cap), and `shadow_reqs` ([request id, tokens, cached
context] of each shadow chunk).
"""
from __future__ import annotations

import json
from pathlib import Path


class StepStatsWriter:
    """Appends one JSON line per step, flushed at once (the /metrics logger tails the file)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path).expanduser()
        self._f = open(self.path, "a", buffering=1)

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


def read_stats(path) -> list[dict]:
    """All step records of a stats file (a partial last line is ignored)."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
