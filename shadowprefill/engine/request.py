"""Requests and their per-step outputs.

A `Request` is one LLM call on one engine: a prompt, a generation limit, a priority class and the SLOs
the shadow controller reads (paper §3.2: arrival time, first-token time, iteration count; it satisfies
`shadow.view.RequestState`). Priorities
order every decision of the scheduler: routed calls (the agent's own calls) before normal traffic before
shadow work (DESIGN.md §1, §5).

Token bookkeeping is uniform for prefill and decode: `all_token_ids = prompt + output`, and
`num_computed_tokens` of them have their K/V in the request's pages. A step feeds the next tokens
`all_token_ids[num_computed_tokens : num_computed_tokens + n]`; when that reaches the end of the known
tokens the step samples the next one. A decode is simply the case of one uncomputed token.
"""
from __future__ import annotations

import enum
import math


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


class Request:
    """One call: prompt, limits, SLOs and the state the scheduler and controller keep for it.

    `ttft_slo` / `tpot_slo` are in seconds (`F_r`, `T_r` of the paper). `prefill_only` requests compute
    the prompt's K/V and finish without sampling (the Eager baseline's shadow requests).
    `replay_token_ids`: the output the request produces, one token per step, instead of what the executor
    samples (a simulator replaying recorded calls; teacher forcing); past its end the sampled tokens count.
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "max_tokens", "priority", "session_id", "tenant",
        "ttft_slo", "tpot_slo", "arrival_time", "arrival_seq", "prefill_only", "internal",
        "status", "output_token_ids", "all_token_ids", "num_computed_tokens", "block_ids",
        "num_committed_blocks", "num_cached_tokens", "num_host_cached_tokens", "first_token_time",
        "finish_time", "num_decode_iters", "num_preemptions", "ready_event", "finish_reason", "admitted",
        "sched_stamp", "samples_now", "replay_token_ids", "prefetch",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int], max_tokens: int, priority: Priority,
                 arrival_time: float, arrival_seq: int, *, session_id: str | None = None, tenant: str = "",
                 ttft_slo: float = math.inf, tpot_slo: float = math.inf, prefill_only: bool = False,
                 internal: bool = False, replay_token_ids: list[int] | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
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
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.num_committed_blocks = 0       # leading pages already registered in the prefix cache
        self.num_cached_tokens = 0          # prompt tokens served from cache at first admission
        self.num_host_cached_tokens = 0     # ... of which came from the host tier
        self.admitted = False
        self.first_token_time: float | None = None   # f_r
        self.finish_time: float | None = None
        self.num_decode_iters = 0           # k_r: iterations completed since the first token (Eq. 1)
        self.num_preemptions = 0
        self.ready_event = None             # host-tier reload the next forward must wait on
        self.prefetch = None                # waiting: its prefix reloaded ahead (a PrefixMatch), or False: tried
        self.finish_reason: str | None = None
        self.sched_stamp = -1               # the scheduler pass that last put it in a batch
        self.samples_now = False            # its chunk in the current batch samples a token
        self.replay_token_ids = replay_token_ids   # output to produce instead of the sampled tokens

    # ------------------------------------------------------------------------------------------ views
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_remaining(self) -> int:
        """Known tokens whose K/V is not computed yet (1 for a decode)."""
        return len(self.all_token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """No first token yet: its slack is the TTFT slack (§3.2), not Eq. 1."""
        return self.first_token_time is None

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.priority.name.lower()}, prompt={self.num_prompt_tokens}, "
                f"out={len(self.output_token_ids)}/{self.max_tokens}, computed={self.num_computed_tokens}, "
                f"{self.status.value})")


class RequestOutput:
    """What `LLMEngine.step()` reports for one request that produced a token or finished this step.

    `token_ids`: the tokens generated so far (a snapshot: later steps do not change it).
    `num_cached_tokens`: prompt tokens served from the prefix cache (device or host) at admission.
    Timing fields are on the engine's clock. Built once per request per step, so it holds only the
    request and a length; everything else is read from the request (fixed once set).
    """

    __slots__ = ("_request", "_n", "finished", "request_id")

    def __init__(self, request: Request, num_output_tokens: int | None = None, finished: bool | None = None) -> None:
        """`num_output_tokens` / `finished`: the request's current values, when the caller knows them."""
        self._request = request
        self.request_id = request.request_id
        # outputs are append-only: a length is a snapshot
        self._n = len(request.output_token_ids) if num_output_tokens is None else num_output_tokens
        self.finished = request.status is RequestStatus.FINISHED if finished is None else finished

    @property
    def token_ids(self) -> list[int]:
        """Tokens generated so far (a new list)."""
        return self._request.output_token_ids[:self._n]

    @property
    def new_token_id(self) -> int | None:
        """The last token generated by this step (None if there is none)."""
        return self._request.output_token_ids[self._n - 1] if self._n else None

    @property
    def num_output_tokens(self) -> int:
        return self._n

    @property
    def num_cached_tokens(self) -> int:
        return self._request.num_cached_tokens

    @property
    def num_host_cached_tokens(self) -> int:
        return self._request.num_host_cached_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self._request.prompt_token_ids)

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
        return self._request.finish_time if self.finished else None

    @property
    def finish_reason(self) -> str | None:
        return self._request.finish_reason if self.finished else None

    @property
    def ttft(self) -> float | None:
        """Time from arrival to the first token, or None before it."""
        first = self.first_token_time
        return None if first is None else first - self._request.arrival_time

    def __repr__(self) -> str:
        return (f"RequestOutput({self.request_id!r}, tokens={self._n}, finished={self.finished}, "
                f"cached={self.num_cached_tokens})")
