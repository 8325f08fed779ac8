"""Recorded inputs: users' agent sessions (JSONL) and normal traffic (Azure LLM inference traces).

JSONL session format (one session per line; `save_sessions` writes it, `load_sessions` reads it):

    {"session_id": "s1", "tenant": "acme", "task": "coding", "arrival_s": 12.5, "token_seed": 7,
     "calls": [{"model": "Qwen2.5-7B", "prompt_tokens": 1500, "output_tokens": 80},
               {"model": "Llama-3.1-70B", "prompt_tokens": 2900, "output_tokens": 120, "gap_s": 1.7},
               {"model": "Llama-3.1-70B", "prompt_tokens": 1800, "prefix_tokens": 1000,
                "output_tokens": 64, "gap_s": 2.1}]}

Session fields: `session_id` (str, unique in the file), `arrival_s` (>= 0: the first call's arrival),
optional `tenant` and `task` (default "default"), optional `token_seed` (int; default derived from the
session id). Call fields: `model` (str: the recorded route); exactly one of `prompt_tokens` (the whole
prompt) and `new_input_tokens` (tokens after the kept prefix); `output_tokens` (>= 1); optional `gap_s`
(>= 0, tool time after the previous call completes; default 0, ignored for the first call); optional
`prefix_tokens`: how many leading tokens of the previous prompt + output this prompt keeps — absent means
all of them (append-only); set it for a prompt that rewrites the history; optional `input_ids` (explicit
token ids of the new input). Unknown keys are errors, so typos do not pass silently.

Normal traffic: request lengths are sampled from quantile tables of the Azure LLM inference traces
(Patel et al., "Splitwise", ISCA 2024; Azure/AzurePublicDataset AzureLLMInferenceTrace_{conv,code}, one
hour, Nov 2023, CC-BY), capped at 8,192 input / 1,024 output tokens as in the paper (§D.1). The tables
below are that data's percentiles (computed by `fit_length_quantiles`); inputs and outputs are sampled
independently (their log-lengths correlate at 0.09 / 0.00 in the traces). Arrivals: Poisson, or a gamma
renewal process with the trace's inter-arrival coefficient of variation (conv 1.09, code 13.2), or a
replay of a trace file given with `--trace` (`load_azure_trace` + `replay_trace`).
"""
from __future__ import annotations

import csv
import datetime as dt
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from shadowprefill.cluster.workloads import Call, Session, token_ids

# ---- JSONL sessions -----------------------------------------------------------------------------------
_SESSION_KEYS = {"session_id", "tenant", "task", "arrival_s", "token_seed", "calls"}
_CALL_KEYS = {"model", "prompt_tokens", "new_input_tokens", "prefix_tokens", "output_tokens", "gap_s", "input_ids"}


def _int_field(obj: dict, key: str, where: str, minimum: int, required: bool = True) -> int | None:
    if key not in obj:
        if required:
            raise ValueError(f"{where}: missing field {key!r}")
        return None
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}.{key}: expected an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{where}.{key}: must be >= {minimum}, got {value}")
    return value


def _number_field(obj: dict, key: str, where: str, default: float | None = None) -> float:
    if key not in obj:
        if default is None:
            raise ValueError(f"{where}: missing field {key!r}")
        return default
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}.{key}: expected a finite number >= 0, got {value!r}")
    return float(value)


def _str_field(obj: dict, key: str, where: str, default: str | None = None) -> str:
    value = obj.get(key, default)
    if value is None:
        raise ValueError(f"{where}: missing field {key!r}")
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}.{key}: expected a non-empty string, got {value!r}")
    return value


def session_from_dict(obj: Any, where: str = "session") -> Session:
    """Parse one JSONL record; errors name `where` and the offending field."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - _SESSION_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: {sorted(_SESSION_KEYS)}")
    sid = _str_field(obj, "session_id", where)
    arrival = _number_field(obj, "arrival_s", where)
    seed = _int_field(obj, "token_seed", where, 0, required=False)
    raw_calls = obj.get("calls")
    if not isinstance(raw_calls, list) or not raw_calls:
        raise ValueError(f"{where}.calls: expected a non-empty list of calls")
    calls: list[Call] = []
    history = 0
    for k, c in enumerate(raw_calls):
        cw = f"{where}.calls[{k}]"
        if not isinstance(c, dict):
            raise ValueError(f"{cw}: expected a JSON object, got {type(c).__name__}")
        unknown = set(c) - _CALL_KEYS
        if unknown:
            raise ValueError(f"{cw}: unknown field(s) {sorted(unknown)}; allowed: {sorted(_CALL_KEYS)}")
        model = _str_field(c, "model", cw)
        prefix = _int_field(c, "prefix_tokens", cw, 0, required=False)
        if prefix is not None and prefix > history:
            raise ValueError(f"{cw}.prefix_tokens: {prefix} exceeds the {history} tokens of history "
                             "(previous prompt + output)")
        kept = history if prefix is None else prefix
        if ("prompt_tokens" in c) == ("new_input_tokens" in c):
            raise ValueError(f"{cw}: give exactly one of 'prompt_tokens' and 'new_input_tokens'")
        if "prompt_tokens" in c:
            prompt = _int_field(c, "prompt_tokens", cw, 1)
            if prompt < kept:
                raise ValueError(f"{cw}.prompt_tokens: {prompt} is shorter than the kept prefix of {kept} tokens "
                                 "(previous prompt + output); set prefix_tokens for a prompt that does not "
                                 "extend the history")
            new = prompt - kept
        else:
            new = _int_field(c, "new_input_tokens", cw, 0)
            if kept + new < 1:
                raise ValueError(f"{cw}.new_input_tokens: the prompt would be empty")
        output = _int_field(c, "output_tokens", cw, 1)
        gap = _number_field(c, "gap_s", cw, default=0.0)
        ids = c.get("input_ids")
        if ids is not None:
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                    for t in ids):
                raise ValueError(f"{cw}.input_ids: expected a list of non-negative integers")
            if len(ids) != new:
                raise ValueError(f"{cw}.input_ids: {len(ids)} ids for {new} new input tokens")
            ids = tuple(ids)
        calls.append(Call(model, new, output, gap, prefix, ids))
        history = kept + new + output
    return Session(sid, _str_field(obj, "tenant", where, "default"), _str_field(obj, "task", where, "default"),
                   arrival, calls, seed)


def session_to_dict(s: Session) -> dict:
    calls = []
    for k, c in enumerate(s.calls):
        d: dict[str, Any] = {"model": c.model, "prompt_tokens": s.prompt_len(k), "output_tokens": c.output_tokens}
        if k and c.gap_s:
            d["gap_s"] = c.gap_s
        if c.prefix_tokens is not None:
            d["prefix_tokens"] = c.prefix_tokens
        if c.input_ids is not None:
            d["input_ids"] = list(c.input_ids)
        calls.append(d)
    return {"session_id": s.session_id, "tenant": s.tenant, "task": s.task, "arrival_s": s.arrival_s,
            "token_seed": s.token_seed, "calls": calls}


def load_sessions(path: "str | Path") -> list[Session]:
    """Read a JSONL session file; errors name the file, line and field. Blank lines are skipped."""
    path = Path(path)
    sessions, seen = [], set()
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            s = session_from_dict(obj, where)
            if s.session_id in seen:
                raise ValueError(f"{where}.session_id: duplicate session id {s.session_id!r}")
            seen.add(s.session_id)
            sessions.append(s)
    if not sessions:
        raise ValueError(f"{path}: no sessions")
    return sessions


def save_sessions(path: "str | Path", sessions: Iterable[Session]) -> None:
    """Write sessions as JSONL (prompt_tokens form), readable by `load_sessions`."""
    with Path(path).open("w") as f:
        for s in sessions:
            f.write(json.dumps(session_to_dict(s)) + "\n")


# ---- normal traffic -----------------------------------------------------------------------------------
LENGTH_PERCENTILES = (0, 1, 2, 5, 10, 15, 20, 25, 30, 40, 50, 60, 70, 75, 80, 85, 90, 95, 98, 99, 99.5, 100)
# Percentiles (above) of ContextTokens capped at 8192 and GeneratedTokens capped at 1024 in
# ../shared/data/azure-llm-2023/AzureLLMInferenceTrace_{conv,code}.csv (19,366 and 8,819 requests).
AZURE_LENGTHS: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "conv": ((2, 29, 91, 181, 207, 372, 387, 396, 403, 703, 1020, 1071, 1130, 1189, 1315, 1876, 2734, 4083, 4098,
              4142, 4831, 8192),
             (7, 16, 24, 41, 54, 67, 77, 85, 91, 103, 129, 177, 384, 395, 400, 411, 424, 451, 540, 601, 643, 1000)),
    "code": ((3, 17, 35, 75, 147, 232, 386, 578, 770, 1075, 1469, 1909, 2433, 2744, 3192, 3920, 5188, 7303, 7436,
              7436, 7436, 7437),
             (6, 6, 6, 6, 7, 7, 8, 9, 9, 11, 13, 16, 20, 24, 29, 39, 55, 90, 171, 251, 359, 1024)),
}
AZURE_RATE = {"conv": 5.53, "code": 2.57}            # requests per second over the hour
AZURE_ARRIVAL_CV = {"conv": 1.09, "code": 13.2}      # inter-arrival std / mean


@dataclass(frozen=True)
class NormalRequest:
    """One request of normal (non-agentic) traffic; its prompt ids come from `token_seed`."""

    request_id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    token_seed: int

    def prompt_ids(self) -> np.ndarray:
        return token_ids(self.token_seed, 0, 0, self.prompt_tokens)


def _inverse_cdf(u: np.ndarray, table: Sequence[int]) -> np.ndarray:
    """Lengths at uniform draws `u`, interpolating the percentile table linearly in log-length."""
    return np.maximum(1, np.rint(np.exp(np.interp(u * 100.0, LENGTH_PERCENTILES, np.log(table))))).astype(np.int64)


def sample_lengths(n: int, rng: np.random.Generator, lengths: str = "conv") -> tuple[np.ndarray, np.ndarray]:
    """`n` (prompt, output) token counts drawn from an Azure trace's length distribution."""
    if lengths not in AZURE_LENGTHS:
        raise ValueError(f"lengths must be one of {sorted(AZURE_LENGTHS)}, got {lengths!r}")
    ins, outs = AZURE_LENGTHS[lengths]
    return _inverse_cdf(rng.random(n), ins), _inverse_cdf(rng.random(n), outs)


def arrival_times(rate: float, duration_s: float, rng: np.random.Generator, process: str = "poisson",
                  cv: float | None = None) -> np.ndarray:
    """Arrival times in [0, duration_s) at mean `rate`: Poisson, or gamma renewal with coefficient `cv`."""
    if not rate > 0 or not duration_s > 0:
        raise ValueError(f"rate and duration_s must be > 0, got rate={rate}, duration_s={duration_s}")
    if process == "poisson":
        shape = 1.0
    elif process == "gamma":
        if cv is None or not cv > 0:
            raise ValueError(f"cv must be > 0 for gamma arrivals, got {cv!r}")
        shape = 1.0 / cv ** 2
    else:
        raise ValueError(f"process must be 'poisson' or 'gamma', got {process!r}")
    times: list[np.ndarray] = []
    t, expected = 0.0, int(rate * duration_s * 1.2) + 16
    while t < duration_s:
        gaps = rng.gamma(shape, 1.0 / (shape * rate), size=expected)
        chunk = t + np.cumsum(gaps)
        times.append(chunk)
        t = float(chunk[-1])
    all_times = np.concatenate(times)
    return all_times[all_times < duration_s]


def normal_traffic(rate: float, duration_s: float, seed: int = 0, lengths: str = "conv", process: str = "poisson",
                   cv: float | None = None, start_s: float = 0.0, first_id: int = 0) -> list[NormalRequest]:
    """Normal requests over [start_s, start_s + duration_s) at `rate` per second, with Azure lengths.
    `process="gamma"` with cv=None uses the trace's own burstiness (`AZURE_ARRIVAL_CV`)."""
    rng = np.random.default_rng([seed, 0x4E0])
    if process == "gamma" and cv is None:
        cv = AZURE_ARRIVAL_CV.get(lengths)
    times = arrival_times(rate, duration_s, rng, process, cv)
    ins, outs = sample_lengths(len(times), rng, lengths)
    seeds = rng.integers(2 ** 62, size=len(times))
    return [NormalRequest(first_id + i, start_s + t, n_in, n_out, token_seed)      # (tolist: Python scalars)
            for i, (t, n_in, n_out, token_seed) in enumerate(zip(times.tolist(), ins.tolist(), outs.tolist(),
                                                                 seeds.tolist()))]


@dataclass(frozen=True)
class TraceRecord:
    """One row of an Azure LLM inference trace: seconds since the first row, capped lengths."""

    time_s: float
    prompt_tokens: int
    output_tokens: int


def load_azure_trace(path: "str | Path", cap_in: int = 8192, cap_out: int = 1024) -> list[TraceRecord]:
    """Read an Azure trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens), capping lengths as the paper
    does; rows are sorted by time. Errors name the file, line and column."""
    path = Path(path)
    if cap_in < 1 or cap_out < 1:
        raise ValueError(f"cap_in and cap_out must be >= 1, got {cap_in}, {cap_out}")
    rows: list[tuple[float, int, int]] = []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: missing column(s) {sorted(missing)}")
        for lineno, row in enumerate(reader, 2):
            try:
                stamp = dt.datetime.fromisoformat(row["TIMESTAMP"].strip()[:26]).timestamp()
            except ValueError:
                raise ValueError(f"{path}:{lineno}: TIMESTAMP {row['TIMESTAMP']!r} is not a timestamp") from None
            values = []
            for col in ("ContextTokens", "GeneratedTokens"):
                try:
                    v = int(row[col])
                except (TypeError, ValueError):
                    raise ValueError(f"{path}:{lineno}: {col} {row[col]!r} is not an integer") from None
                if v < 1:
                    raise ValueError(f"{path}:{lineno}: {col} must be >= 1, got {v}")
                values.append(v)
            rows.append((stamp, min(values[0], cap_in), min(values[1], cap_out)))
    if not rows:
        raise ValueError(f"{path}: no requests")
    rows.sort()
    t0 = rows[0][0]
    return [TraceRecord(t - t0, p, o) for t, p, o in rows]


def replay_trace(records: Sequence[TraceRecord], rate: float | None = None, duration_s: float | None = None,
                 start_s: float = 0.0, seed: int = 0, first_id: int = 0) -> list[NormalRequest]:
    """Normal requests replaying a trace: times rescaled so the mean rate is `rate` (default: the trace's
    own), looped until `duration_s` (default: one pass)."""
    if not records:
        raise ValueError("records must not be empty")
    span = records[-1].time_s + (records[-1].time_s / max(1, len(records) - 1))   # one pass incl. last gap
    if span <= 0 and (rate is not None or duration_s is not None):
        raise ValueError("records: a trace needs at least two distinct timestamps to be rescaled or looped")
    if rate is not None and not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    scale = 1.0 if rate is None else len(records) / span / rate
    period = span * scale
    rng = np.random.default_rng([seed, 0x7EA])

    def request(t: float, r: TraceRecord) -> NormalRequest:
        return NormalRequest(first_id + len(out), start_s + t, r.prompt_tokens, r.output_tokens,
                             int(rng.integers(2 ** 62)))

    out: list[NormalRequest] = []
    if duration_s is None:                                            # one pass
        for r in records:
            out.append(request(r.time_s * scale, r))
        return out
    loop = 0
    while loop * period < duration_s:
        for r in records:
            t = loop * period + r.time_s * scale
            if t >= duration_s:
                break
            out.append(request(t, r))
        loop += 1
    return out


def fit_length_quantiles(records: Sequence[TraceRecord]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (prompt, output) percentile tables of a trace, in the form of `AZURE_LENGTHS`."""
    ins = np.array([r.prompt_tokens for r in records], dtype=float)
    outs = np.array([r.output_tokens for r in records], dtype=float)
    return (tuple(int(round(v)) for v in np.percentile(ins, LENGTH_PERCENTILES)),
            tuple(int(round(v)) for v in np.percentile(outs, LENGTH_PERCENTILES)))
