"""Requests and their per-step outputs.

A `Request` is one LLM call on one engine: a prompt, a generation limit, a priority class and the state
the scheduler keeps for it, with the inputs the shadow controller reads every iteration (paper §3.2: the
SLOs F_r / T_r, arrival a_r, first-token time f_r, iteration count k_r; it satisfies
`shadow.view.RequestState`). What neither of them reads is split off by owner: the SLO accounting of its
outcome (`SLOAccounting`, `Request.slo`: finish time and reason, the prompt tokens its admission found
cached) and its simulation replay data (`OutputReplay`, `Request.replay`). Priorities
order every decision of the scheduler: routed calls (the agent's own calls) before normal traffic before
shadow work (DESIGN.md §1, §5).

Token bookkeeping is uniform for prefill and decode: `all_token_ids = prompt + output` (`num_tokens` of
them), and `num_computed_tokens` of them have their K/V in the request's pages. A step feeds the next tokens
`all_token_ids[num_computed_tokens : num_computed_tokens + n]`; when that reaches the end of the known
tokens the step samples the next one. A decode is simply the case of one uncomputed token.
"""
from __future__ import annotations

import enum
import math
import operator

from shadowprefill.cluster.call_stats import time_to_first_token


class Priority(enum.IntEnum):
    """Scheduling class; a lower value is served first."""

    ROUTED = 0
    NORMAL = 1
    SHADOW = 2

    @classmethod
    def parse(cls, value: "str | Priority") -> "Priority":
        """`"routed"` / `"normal"` / `"shadow"` (or a Priority) -> Priority; ValueError otherwise."""
        if isinstance(value, Priority):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        raise ValueError(f"priority must be 'routed', 'normal' or 'shadow', got {value!r}")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class OutputReplay:
    """Simulation replay data of one request, kept apart from its scheduling state: `token_ids`, the output
    it produces one token per step instead of what the executor samples (a simulator replaying recorded
    calls; teacher forcing; None: none), then `fill_token` for every further token an executor that samples
    nothing counts (None: such tokens have no value)."""

    __slots__ = ("token_ids", "fill_token")

    def __init__(self, token_ids: list[int] | None = None, fill_token: int | None = None) -> None:
        self.token_ids = token_ids
        self.fill_token = fill_token


class SLOAccounting:
    """A request's SLO accounting, kept apart from its scheduling state: what its outcome is measured by
    and no scheduling decision reads (the §5 metrics, a RequestOutput): the finish time and reason, and the
    prompt tokens its first admission found cached (device or host), of them on the host tier. (The SLO
    inputs of Algorithm 1, F_r, T_r, a_r, f_r, k_r, stay on the Request: the controller reads them for every
    decode of every iteration, where a read-through would cost a Python call each.)"""

    __slots__ = ("finish_time", "finish_reason", "num_cached_tokens", "num_host_cached_tokens")

    def __init__(self) -> None:
        self.finish_time: float | None = None
        self.finish_reason: str | None = None
        self.num_cached_tokens = 0                   # prompt tokens served from cache at first admission
        self.num_host_cached_tokens = 0              # ... of which came from the host tier


def _slo_field(name: str, doc: str) -> property:
    """Request.<name>: read through to (and written to) request.slo.<name>."""
    get = operator.attrgetter(f"slo.{name}")

    def set_(self, value) -> None:
        setattr(self.slo, name, value)
    return property(get, set_, doc=doc)


class Request:
    """One call: prompt, limits, SLOs and the state the scheduler and controller keep for it.

    `ttft_slo` / `tpot_slo` are in seconds (`F_r`, `T_r` of the paper). Its SLO accounting (finish time
    and reason, cached prompt tokens) is `slo`, an `SLOAccounting`, read through from here. `prefill_only`
    requests compute
    the prompt's K/V and finish without sampling (the Eager baseline's shadow requests).
    `replay_token_ids` / `fill_token`: its simulation replay data (held in an `OutputReplay`, `replay`): the
    output the request produces, one token per step, instead of what the executor samples (a simulator
    replaying recorded calls; teacher forcing); past its end the sampled tokens count.
    `stream`: report a RequestOutput at every token (False: only when it finishes).

    Tokens are one list, prompt then output, and a count `num_tokens`. A real executor samples every token,
    and each is appended at once. A simulated one samples nothing (`ExecuteResult.tokens` None): the request
    then only counts its new tokens, whose values are known anyway (its replayed output, then `fill_token`),
    and the list is filled in where tokens are read (`all_token_ids`, `token_ids_upto`: page hashes,
    recompute after preemption, a RequestOutput's `token_ids`).
    """

    __slots__ = (
        "request_id", "_token_ids", "num_prompt_tokens", "num_tokens", "max_tokens", "priority", "session_id",
        "tenant", "ttft_slo", "tpot_slo", "arrival_time", "arrival_seq", "prefill_only", "internal", "stream",
        "status", "num_computed_tokens", "block_ids", "num_committed_blocks", "first_token_time",
        "num_decode_iters", "num_preemptions", "ready_event", "admitted", "sched_stamp", "samples_now",
        "check_at", "prefetch", "slo", "replay",
    )

    # the SLO accounting, read through to `slo`
    finish_time = _slo_field("finish_time", "When it finished; None before.")
    finish_reason = _slo_field("finish_reason", "Why it finished ('stop', 'length', 'prefilled', 'abort').")
    num_cached_tokens = _slo_field("num_cached_tokens", "Prompt tokens served from cache at first admission.")
    num_host_cached_tokens = _slo_field("num_host_cached_tokens", "... of which came from the host tier.")

    def __init__(self, request_id: str, prompt_token_ids: list[int], max_tokens: int, priority: Priority,
                 arrival_time: float, arrival_seq: int, *, session_id: str | None = None, tenant: str = "",
                 ttft_slo: float = math.inf, tpot_slo: float = math.inf, prefill_only: bool = False,
                 internal: bool = False, replay_token_ids: list[int] | None = None, stream: bool = True,
                 fill_token: int | None = None, own_prompt: bool = False) -> None:
        """`own_prompt`: prompt_token_ids is a list made for this request (kept, not copied)."""
        self.request_id = request_id
        # prompt, then the output known so far
        self._token_ids: list[int] = prompt_token_ids if own_prompt else list(prompt_token_ids)
        self.num_prompt_tokens = len(self._token_ids)
        self.num_tokens = self.num_prompt_tokens     # prompt + output tokens (some maybe not in the list yet)
        self.max_tokens = max_tokens
        self.priority = priority
        self.session_id = session_id
        self.tenant = tenant
        self.ttft_slo = ttft_slo
        self.tpot_slo = tpot_slo
        self.arrival_time = arrival_time
        self.arrival_seq = arrival_seq
        self.prefill_only = prefill_only
        self.internal = internal            # engine-made (Eager shadow): produces no RequestOutput
        self.stream = stream and not internal
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.num_committed_blocks = 0       # leading pages already registered in the prefix cache
        self.admitted = False
        self.first_token_time: float | None = None   # f_r
        self.num_decode_iters = 0           # k_r: iterations completed since the first token (Eq. 1)
        self.num_preemptions = 0
        self.ready_event = None             # host-tier reload the next forward must wait on
        self.prefetch = None                # waiting: its prefix reloaded ahead (a PrefixMatch), or False: tried
        self.slo = SLOAccounting()          # its outcome's accounting (finish, cache hits): read through
        self.sched_stamp = -1               # the scheduler pass that last gave it a prefill chunk
        self.samples_now = False            # its chunk in the current batch samples a token
        self.replay = (OutputReplay(replay_token_ids, fill_token)     # simulation replay data, or None
                       if replay_token_ids is not None or fill_token is not None else None)
        self.check_at = 0                   # scheduler: num_tokens at which a decode next needs more than a
                                            # count (0: at every token)

    # ----------------------------------------------------------------------------------------- tokens
    def token_ids_upto(self, n: int) -> list[int]:
        """The token list with at least its first `n` tokens filled in (n <= num_tokens); the live list."""
        toks = self._token_ids
        have = len(toks)
        if have < n:
            p = self.num_prompt_tokens
            rp = self.replay
            replay = rp.token_ids if rp is not None else None
            if replay is not None and have - p < len(replay):
                toks += replay[have - p:n - p]
                have = len(toks)
            if have < n:
                if rp is None or rp.fill_token is None:
                    raise RuntimeError(f"request {self.request_id!r}: {n - have} counted tokens have no value "
                                       "(no fill_token)")
                toks += [rp.fill_token] * (n - have)
        return toks

    def put_token(self, sampled: int) -> int:
        """Store the next output token (the replayed one while the replay lasts, else `sampled`) in the list,
        not yet counted in num_tokens (the scheduler counts it); returns it."""
        n = self.num_tokens
        toks = self._token_ids if len(self._token_ids) == n else self.token_ids_upto(n)
        del toks[n:]                        # (a token stored but never counted: its step was dropped)
        i = n - self.num_prompt_tokens
        rp = self.replay
        replay = rp.token_ids if rp is not None else None
        tok = replay[i] if replay is not None and i < len(replay) else sampled
        toks.append(tok)
        return tok

    def append_token(self, sampled: int) -> int:
        """put_token and count it: the request has one more token; returns it."""
        tok = self.put_token(sampled)
        self.num_tokens += 1
        return tok

    def token_at(self, i: int) -> int:
        """Token i of prompt + output (i < num_tokens)."""
        return self.token_ids_upto(i + 1)[i]

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output tokens (the request's live list: read it, do not change it)."""
        return self.token_ids_upto(self.num_tokens)

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt (a new list)."""
        return self._token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """Tokens generated so far (a new list)."""
        return self.token_ids_upto(self.num_tokens)[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    # ------------------------------------------------------------------------------------------ views
    @property
    def num_remaining(self) -> int:
        """Known tokens whose K/V is not computed yet (1 for a decode)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """No first token yet: its slack is the TTFT slack (§3.2), not Eq. 1."""
        return self.first_token_time is None

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.priority.name.lower()}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}/{self.max_tokens}, computed={self.num_computed_tokens}, "
                f"{self.status.value})")


class RequestOutput:
    """What `LLMEngine.step()` reports for one request that produced a token this step (if it streams) or
    finished this step.

    `token_ids`: the tokens generated so far (a snapshot: later steps do not change it).
    `num_cached_tokens`: prompt tokens served from the prefix cache (device or host) at admission.
    Timing fields are on the engine's clock. Built once per streaming request per step (once per other
    request), so it holds only the request and a length; everything else is read from the request (fixed
    once set; counted tokens are filled in when `token_ids` is read).
    """

    __slots__ = ("_request", "_n", "finished", "request_id")

    def __init__(self, request: Request, num_output_tokens: int | None = None, finished: bool | None = None) -> None:
        """`num_output_tokens` / `finished`: the request's current values, when the caller knows them."""
        self._request = request
        self.request_id = request.request_id
        # outputs are append-only: a length is a snapshot
        self._n = request.num_output_tokens if num_output_tokens is None else num_output_tokens
        self.finished = request.status is RequestStatus.FINISHED if finished is None else finished

    @property
    def token_ids(self) -> list[int]:
        """Tokens generated so far (a new list)."""
        r = self._request
        p = r.num_prompt_tokens
        return r.token_ids_upto(p + self._n)[p:p + self._n]

    @property
    def new_token_id(self) -> int | None:
        """The last token generated by this step (None if there is none)."""
        return self._request.token_at(self._request.num_prompt_tokens + self._n - 1) if self._n else None

    @property
    def num_output_tokens(self) -> int:
        return self._n

    @property
    def num_cached_tokens(self) -> int:
        return self._request.slo.num_cached_tokens

    @property
    def num_host_cached_tokens(self) -> int:
        return self._request.slo.num_host_cached_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return self._request.num_prompt_tokens

    @property
    def session_id(self) -> str | None:
        return self._request.session_id

    @property
    def priority(self) -> Priority:
        return self._request.priority

    @property
    def arrival_time(self) -> float:
        return self._request.arrival_time

    @property
    def first_token_time(self) -> float | None:
        return self._request.first_token_time if self._n else None

    @property
    def finish_time(self) -> float | None:
        return self._request.slo.finish_time if self.finished else None

    @property
    def finish_reason(self) -> str | None:
        return self._request.slo.finish_reason if self.finished else None

    @property
    def ttft(self) -> float | None:
        """Time from arrival to the first token, or None before it (cluster.call_stats.time_to_first_token)."""
        return time_to_first_token(self._request.arrival_time, self.first_token_time)

    def __repr__(self) -> str:
        return (f"RequestOutput({self.request_id!r}, tokens={self._n}, finished={self.finished}, "
                f"cached={self.num_cached_tokens})")
