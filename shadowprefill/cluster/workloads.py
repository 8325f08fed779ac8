"""Agentic sessions: the data model and generators matching the paper's Table 1.

A `Session` is a sequence of LLM `Call`s issued one after another: call k+1 arrives `gap_s` (tool time)
after call k completes. Call k's prompt is the session history (all earlier prompts and outputs) followed
by the call's new input: append-only by construction (paper §2.1: "append each step's input, output, and
a tool result to the history"). A call with `prefix_tokens` set keeps only that many leading history
tokens (e.g. compaction into a 1K-token summary when the context reaches the window, paper §4).

Token identity matters (prefix caches hash real ids), so ids are deterministic: call k's new input and
recorded output (kind 0 or 1) are `token_list(token_seed, k, kind, n)`: four ids that encode a 64-bit mix
of (token_seed, k, kind), the sequence's identity, then a slice of one fixed pool of random ids at an
offset drawn from the same mix, all in [FIRST_TOKEN_ID, VOCAB_LIMIT), a range every catalog model's
vocabulary covers. Prefix caches hash chains of full pages, so two sequences share a cached page only where
everything before it is the same: the identity ids make every generated sequence start unlike every other,
which is all a prefix cache can see of randomness. (Drawing every id from a fresh generator, as before,
cost ~150 µs per 2,000-id request in generation and conversion to Python ints; a pool slice is ~10 µs.)

The JSONL format for a user's own sessions lives in `shadowprefill.cluster.traces`.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Sequence

import numpy as np

from shadowprefill.shadow.jobs import CheckedTokenIds

VOCAB_LIMIT = 32000     # smallest vocabulary in the catalog (Mixtral-8x7B)
FIRST_TOKEN_ID = 10     # keep clear of BOS/EOS/pad ids


def _derived_seed(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


_POOL_SIZE = 1 << 18                        # the shared body pool: 262,144 ids
_HEAD = 4                                   # identity ids per sequence (4 base-31,990 digits: 59.9 bits)
_SPAN = VOCAB_LIMIT - FIRST_TOKEN_ID
_M64 = (1 << 64) - 1


@lru_cache(maxsize=1)
def _token_pool() -> tuple[np.ndarray, list[int]]:
    """The fixed pool of random ids (fixed seed) as an int32 array and as Python ints (sliced, not copied)."""
    pool = np.random.default_rng(0x70CE_1D5).integers(FIRST_TOKEN_ID, VOCAB_LIMIT, size=_POOL_SIZE, dtype=np.int32)
    return pool, pool.tolist()


def _mix64(z: int) -> int:
    """SplitMix64's finalizer: a bijection on 64-bit ints that spreads every input bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _layout(token_seed: int, call_index: int, kind: int, n: int) -> tuple[list[int], int, int]:
    """(identity ids, pool offset, body length) of a generated sequence."""
    for name, v in (("token_seed", token_seed), ("call_index", call_index), ("kind", kind), ("n", n)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    key = _mix64((_mix64(int(token_seed) & _M64) ^ ((int(call_index) << 1) | int(kind))) & _M64)
    z, head = key, []
    for _ in range(min(n, _HEAD)):
        z, digit = divmod(z, _SPAN)
        head.append(FIRST_TOKEN_ID + digit)
    body = n - len(head)
    offset = _mix64(key ^ 0x5EED) % (_POOL_SIZE - min(body, _POOL_SIZE) + 1)
    return head, offset, body


def _body_slices(offset: int, body: int) -> list[tuple[int, int]]:
    """The pool slices of a body of `body` ids from `offset` (a body longer than the pool wraps around it)."""
    out = []
    while body > 0:
        take = min(body, _POOL_SIZE - offset)
        out.append((offset, offset + take))
        body, offset = body - take, 0
    return out


def token_list(token_seed: int, call_index: int, kind: int, n: int) -> list[int]:
    """Deterministic token ids as a new list of Python ints (kind 0: a call's new input, 1: its recorded
    output): the sequence's identity ids, then a slice of the shared pool (module docstring). The result is
    a `shadow.jobs.CheckedTokenIds`: the engine takes it without a per-id check."""
    head, offset, body = _layout(token_seed, call_index, kind, n)
    pool = _token_pool()[1]
    out = CheckedTokenIds(head)
    for start, stop in _body_slices(offset, body):
        out += pool[start:stop]
    return out


def token_ids(token_seed: int, call_index: int, kind: int, n: int) -> np.ndarray:
    """The same ids as `token_list`, as an int32 array."""
    head, offset, body = _layout(token_seed, call_index, kind, n)
    pool = _token_pool()[0]
    return np.concatenate([np.asarray(head, dtype=np.int32)] + [pool[a:b] for a, b in _body_slices(offset, body)])


@dataclass(frozen=True)
class Call:
    """One LLM call of a session (see module docstring for the prompt it implies)."""

    model: str                          # recorded route
    new_input_tokens: int               # tokens appended after the kept history prefix
    output_tokens: int
    gap_s: float = 0.0                  # tool/think time before this call (after the previous completes)
    prefix_tokens: int | None = None    # None: append-only (keep the whole history)
    input_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"Call.model must be a non-empty str, got {self.model!r}")
        for name in ("new_input_tokens", "output_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"Call.{name} must be an int >= 0, got {value!r}")
        if self.output_tokens < 1:
            raise ValueError(f"Call.output_tokens must be >= 1, got {self.output_tokens}")
        if not (isinstance(self.gap_s, (int, float)) and math.isfinite(self.gap_s) and self.gap_s >= 0):
            raise ValueError(f"Call.gap_s must be a finite number >= 0, got {self.gap_s!r}")
        if self.prefix_tokens is not None and (isinstance(self.prefix_tokens, bool) or
                                               not isinstance(self.prefix_tokens, (int, np.integer))
                                               or self.prefix_tokens < 0):
            raise ValueError(f"Call.prefix_tokens must be None or an int >= 0, got {self.prefix_tokens!r}")
        if self.input_ids is not None and len(self.input_ids) != self.new_input_tokens:
            raise ValueError(f"Call.input_ids has {len(self.input_ids)} ids but new_input_tokens is "
                             f"{self.new_input_tokens}")

    @property
    def append_only(self) -> bool:
        return self.prefix_tokens is None


@dataclass
class Session:
    """An agent session: calls in order, the first arriving at `arrival_s` (seconds)."""

    session_id: str
    tenant: str
    task: str
    arrival_s: float
    calls: list[Call]
    token_seed: int | None = None
    _prompt_lens: list[int] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.session_id, str) or not self.session_id:
            raise ValueError(f"Session.session_id must be a non-empty str, got {self.session_id!r}")
        if not (isinstance(self.arrival_s, (int, float)) and math.isfinite(self.arrival_s) and self.arrival_s >= 0):
            raise ValueError(f"Session.arrival_s must be a finite number >= 0, got {self.arrival_s!r}")
        if not self.calls:
            raise ValueError(f"Session {self.session_id!r}: calls must not be empty")
        if self.token_seed is None:
            self.token_seed = _derived_seed(self.session_id)
        history = 0
        for k, call in enumerate(self.calls):
            if not isinstance(call, Call):
                raise TypeError(f"Session {self.session_id!r}: calls[{k}] must be a Call")
            kept = history if call.prefix_tokens is None else call.prefix_tokens
            if kept > history:
                raise ValueError(f"Session {self.session_id!r}: calls[{k}].prefix_tokens={kept} exceeds the "
                                 f"history of {history} tokens (previous prompt + output)")
            prompt = kept + call.new_input_tokens
            if prompt < 1:
                raise ValueError(f"Session {self.session_id!r}: calls[{k}] has an empty prompt")
            self._prompt_lens.append(prompt)
            history = prompt + call.output_tokens

    # ---- lengths ----------------------------------------------------------------------------------------
    def prompt_len(self, k: int) -> int:
        return self._prompt_lens[k]

    def history_len(self, k: int) -> int:
        """Tokens of history before call k (previous prompt + its output; 0 for the first call)."""
        return 0 if k == 0 else self._prompt_lens[k - 1] + self.calls[k - 1].output_tokens

    def kept_prefix(self, k: int) -> int:
        """Leading history tokens call k's prompt keeps."""
        p = self.calls[k].prefix_tokens
        return self.history_len(k) if p is None else p

    # ---- token ids --------------------------------------------------------------------------------------
    def new_input_ids(self, k: int) -> np.ndarray:
        call = self.calls[k]
        if call.input_ids is not None:
            return np.asarray(call.input_ids, dtype=np.int32)
        return token_ids(self.token_seed, k, 0, call.new_input_tokens)

    def output_ids(self, k: int) -> np.ndarray:
        """Recorded output of call k (what replay appends to the history)."""
        return token_ids(self.token_seed, k, 1, self.calls[k].output_tokens)

    def prompt_ids(self, k: int, outputs: Sequence[Sequence[int]] | None = None) -> np.ndarray:
        """Token ids of call k's prompt. `outputs[j]` replaces call j's recorded output (e.g. the tokens a
        model actually generated), for j < k."""
        if not 0 <= k < len(self.calls):
            raise IndexError(f"call index {k} out of range for {len(self.calls)} calls")
        history = np.zeros(0, dtype=np.int32)
        for j in range(k + 1):
            prompt = np.concatenate([history[:self.kept_prefix(j) if j else 0], self.new_input_ids(j)])
            if j == k:
                return prompt
            out = self.output_ids(j) if outputs is None or outputs[j] is None else np.asarray(outputs[j], np.int32)
            history = np.concatenate([prompt, out])
        raise AssertionError("unreachable")

    @property
    def models(self) -> list[str]:
        return [c.model for c in self.calls]


# ---- statistics ---------------------------------------------------------------------------------------
def session_stats(sessions: Sequence[Session]) -> dict[str, float]:
    """Table 1 statistics of recorded sessions: switch rate (over all calls), switches per session,
    calls per session, mean and p99 prompt, mean output, and the token-weighted prefix hit rate of all
    calls and of switch calls under an unbounded per-model cache (an upper bound of what a real pool hits;
    new-input tokens are assumed fresh, as generated ids are)."""
    if not sessions:
        raise ValueError("sessions must not be empty")
    prompts, outputs = [], []
    switches = calls = 0
    hit = total = sw_hit = sw_total = 0
    for s in sessions:
        last_seen: dict[str, int] = {}        # model -> index of its last call
        for k, call in enumerate(s.calls):
            p = s.prompt_len(k)
            prompts.append(p)
            outputs.append(call.output_tokens)
            calls += 1
            switched = k > 0 and call.model != s.calls[k - 1].model
            switches += switched
            cached = 0
            j = last_seen.get(call.model)
            if j is not None:                 # common prefix with that call's prompt + output
                cached = s.prompt_len(j) + s.calls[j].output_tokens
                for i in range(j + 1, k + 1):
                    cached = min(cached, s.kept_prefix(i))
                cached = min(cached, p - 1)   # the last prompt token is always computed
            hit += cached
            total += p
            if switched:
                sw_hit += cached
                sw_total += p
            last_seen[call.model] = k
    prompts_a = np.array(prompts, dtype=float)
    return {
        "sessions": len(sessions), "calls": calls, "calls_per_session": calls / len(sessions),
        "switch_rate": switches / calls, "switches_per_session": switches / len(sessions),
        "prompt_mean": float(prompts_a.mean()), "prompt_p99": float(np.percentile(prompts_a, 99)),
        "output_mean": float(np.mean(outputs)),
        "hit_rate": hit / total, "switch_hit_rate": (sw_hit / sw_total) if sw_total else float("nan"),
    }


# ---- generators ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Table1Row:
    """Paper Table 1 statistics of one routed workload (hit rates: measured by the paper's simulator under
    No Shadow, i.e. with eviction; an unbounded cache hits more)."""

    switch_rate: float            # fraction of calls that switch model
    switches_per_session: float
    prompt_mean: float            # tokens
    prompt_p99: float
    hit_rate: float               # token-weighted prefix hit rate, all calls
    switch_hit_rate: float        # ... of switch calls


TABLE1: dict[str, Table1Row] = {
    "xroutebench": Table1Row(0.19, 2.3, 19e3, 113e3, 0.804, 0.52),
    "fusionbench": Table1Row(0.26, 3.1, 13e3, 58e3, 0.766, 0.52),
    "router-r1": Table1Row(0.33, 4.1, 10e3, 45e3, 0.692, 0.46),
    "ghcp-coding": Table1Row(0.26, 2.0, 63e3, 131e3, 0.554, 0.44),
    "swe-bench": Table1Row(0.26, 10.9, 36e3, 93e3, 0.952, 0.65),
}


@dataclass(frozen=True)
class WorkloadSpec:
    """Generator parameters of one workload. Lengths are lognormal (median, sigma) in tokens.

    Calls per session: lognormal with mean `calls_mean`, capped at `max_calls`. Routes: a Markov chain per
    session that switches model with probability `switch_p` × the task's scale (tasks equally likely, so
    the switch probability depends on the task, as the paper's predictor assumes). First call: the initial
    context (system prompt + task). Later calls: a tool result (paper: lognormal, median 1K tokens) plus a
    short step input. Tool gaps: lognormal, median 2 s (appendix D.1).
    """

    name: str
    calls_mean: float
    calls_sigma: float
    max_calls: int
    switch_p: float
    initial: tuple[float, float]
    tool: tuple[float, float]
    step: tuple[float, float]
    output: tuple[float, float]
    session_rate: float                       # sessions per second (Poisson)
    tool_prob: float = 1.0                    # share of steps that carry a tool result (§4: "optionally")
    task_switch_scale: tuple[float, ...] = (0.5, 0.8, 1.2, 1.5)
    max_output: int = 4096
    gap_s: tuple[float, float] = (2.0, 1.0)
    context_window: int = 131072              # compact the history into a summary beyond this (§4)
    summary_tokens: int = 1024

    def tasks(self) -> list[str]:
        return [f"{self.name}/task{i}" for i in range(len(self.task_switch_scale))]


# calls_mean = Table 1 switches per session / switch rate; switch_p then gives the switch rate. The length
# parameters (tool median fixed at the paper's 1K) were found by random search matching Table 1's mean and
# p99 prompt, preferring an unbounded-cache hit rate above the paper's measured one, and checked on 4 seeds
# x 2,000 sessions (tests/cluster/test_workloads.py states the tolerances). Output medians: Table 5
# (FusionBench 52-97, SWE-bench 175-249 mean output tokens); others assumed. Session rates: appendix D.1
# (FusionBench 0.05/s, SWE-bench 0.01/s); others assumed.
WORKLOADS: dict[str, WorkloadSpec] = {w.name: w for w in (
    WorkloadSpec("xroutebench", calls_mean=12.1, calls_sigma=0.96, max_calls=100, switch_p=0.211,
                 initial=(1226, 1.0), tool=(1000, 1.33), step=(50, 2.43), tool_prob=0.25, output=(80, 0.9),
                 session_rate=0.05),
    WorkloadSpec("fusionbench", calls_mean=11.9, calls_sigma=0.54, max_calls=100, switch_p=0.286,
                 initial=(479, 1.0), tool=(1000, 1.08), step=(99, 1.13), tool_prob=0.75, output=(60, 0.8),
                 session_rate=0.05),
    WorkloadSpec("router-r1", calls_mean=12.4, calls_sigma=0.67, max_calls=100, switch_p=0.365,
                 initial=(800, 1.0), tool=(1000, 0.70), step=(79, 1.45), tool_prob=0.5, output=(80, 0.9),
                 session_rate=0.05),
    WorkloadSpec("ghcp-coding", calls_mean=7.7, calls_sigma=0.96, max_calls=60, switch_p=0.306,
                 initial=(30174, 0.5), tool=(1000, 1.02), step=(1798, 1.75), tool_prob=0.75, output=(150, 1.0),
                 session_rate=0.02),
    WorkloadSpec("swe-bench", calls_mean=41.9, calls_sigma=0.28, max_calls=75, switch_p=0.27,
                 initial=(2500, 0.4), tool=(1000, 0.57), step=(74, 0.85), tool_prob=1.0, output=(150, 0.8),
                 session_rate=0.01),
)}


def _lognormal(rng: np.random.Generator, median_sigma: tuple[float, float], minimum: int = 1,
               maximum: int | None = None) -> int:
    median, sigma = median_sigma
    value = int(round(median * math.exp(sigma * rng.standard_normal())))
    value = max(minimum, value)
    return value if maximum is None else min(value, maximum)


def generate_session(spec: WorkloadSpec, models: Sequence[str], index: int, arrival_s: float, seed: int = 0,
                     tenant: str = "default") -> Session:
    """Session `index` of `spec` (deterministic in seed and index) with routes over `models`."""
    if len(models) < 1:
        raise ValueError("models must name at least one model")
    rng = np.random.default_rng([seed, index, 0x5E55])
    mu = math.log(spec.calls_mean) - spec.calls_sigma ** 2 / 2          # lognormal with that mean
    n_calls = min(spec.max_calls, max(1, int(round(math.exp(mu + spec.calls_sigma * rng.standard_normal())))))
    task_index = int(rng.integers(len(spec.task_switch_scale)))
    switch_p = min(0.95, spec.switch_p * spec.task_switch_scale[task_index])
    model = models[int(rng.integers(len(models)))]
    calls: list[Call] = []
    initial = _lognormal(rng, spec.initial, maximum=spec.context_window // 2)
    history = 0
    for k in range(n_calls):
        if k and len(models) > 1 and rng.random() < switch_p:                # Markov route
            others = [m for m in models if m != model]
            model = others[int(rng.integers(len(others)))]
        output = _lognormal(rng, spec.output, maximum=spec.max_output)
        if k == 0:
            calls.append(Call(model, initial, output))
            history = initial + output
            continue
        new = _lognormal(rng, spec.step)
        if rng.random() < spec.tool_prob:
            new += _lognormal(rng, spec.tool)
        gap = spec.gap_s[0] * math.exp(spec.gap_s[1] * rng.standard_normal())
        if history + new > spec.context_window:                              # compaction (§4)
            new = min(new, spec.context_window - initial - spec.summary_tokens)
            calls.append(Call(model, spec.summary_tokens + new, output, gap, prefix_tokens=initial))
            history = initial + spec.summary_tokens + new + output
        else:
            calls.append(Call(model, new, output, gap))
            history += new + output
    return Session(f"{spec.name}-{seed}-{index}", tenant, spec.tasks()[task_index], arrival_s, calls,
                   token_seed=int(rng.integers(2 ** 62)))


def generate_sessions(workload: "str | WorkloadSpec", models: Sequence[str], *, duration_s: float | None = None,
                      num_sessions: int | None = None, seed: int = 0, start_s: float = 0.0,
                      session_rate: float | None = None, tenants: int = 1) -> list[Session]:
    """Sessions with Poisson arrivals at `session_rate` (default: the workload's) from `start_s`, until
    `duration_s` has passed or `num_sessions` were made (give exactly one). Routes are recorded over
    `models` (e.g. a pair from `shadowprefill.model.catalog.PAIRS`)."""
    spec = get_workload(workload)
    if (duration_s is None) == (num_sessions is None):
        raise ValueError("give exactly one of duration_s and num_sessions")
    rate = spec.session_rate if session_rate is None else session_rate
    if not rate > 0:
        raise ValueError(f"session_rate must be > 0, got {rate}")
    if isinstance(tenants, bool) or not isinstance(tenants, int) or tenants < 1:
        raise ValueError(f"tenants must be an int >= 1, got {tenants!r}")
    models = list(models)
    if not models or not all(isinstance(m, str) and m for m in models):
        raise ValueError(f"models must be a non-empty list of model names, got {models!r}")
    arrivals = np.random.default_rng([seed, 0xA11]).exponential(1.0 / rate, size=1 << 20)
    sessions: list[Session] = []
    t = start_s
    for i in range(len(arrivals)):
        t += float(arrivals[i])
        if num_sessions is not None and i >= num_sessions:
            break
        if duration_s is not None and t > start_s + duration_s:
            break
        sessions.append(generate_session(spec, models, i, t, seed, tenant=f"tenant{i % tenants}"))
    return sessions


def get_workload(workload: "str | WorkloadSpec") -> WorkloadSpec:
    if isinstance(workload, WorkloadSpec):
        return workload
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; known: {sorted(WORKLOADS)}")
    return WORKLOADS[workload]
