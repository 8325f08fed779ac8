"""HTTP backend of the orchestration core: one OpenAI-compatible upstream server as an `InstanceHandle`.

The core (`cluster.manager.ClusterManager`) places calls; the control plane decides the shadows
(`ControlPlane.plan_shadows`, through the manager); an `HttpInstance` carries them out over HTTP (paper appendix D.1, no engine changes):

- `submit_call` builds the upstream request of a routed call (the front door sends it and streams the
  answer through);
- shadows are request-level: `upsert_shadow` queues the completed call as one lowest-priority request
  with `max_tokens: 1` on this server's `ShadowDispatcher` (superseding the session's pending one),
  `cancel_shadow` drops it (and aborts the session's in-flight one); output is not forwarded token by
  token (`incremental = False`): streamed shadows (`serve.shadow_stream`) send superseding requests for
  whole blocks of the growing history instead;
- health: a connection failure marks the server down for `dead_retry_s` (`mark_down`), and placement
  skips it until then.

Placement estimate (§3.1 "lowest estimated prefill completion time, counting only uncached tokens"):
the prefill this manager has queued on the server (calls sent and not answered yet, each counted by its
uncached part) plus this prompt's part the server does not hold, at `prefill_tokens_per_s`. What a server
holds is this manager's belief: per session, what it last sent there (a completed call's prompt + answer,
or a completed shadow), compared with the new prompt as token ids or as text (`sessions.comparable`);
eviction on the server is not seen. One fixed rate is used for every server, so instances of one model
compare by tokens.
"""
from __future__ import annotations

import time
from collections import OrderedDict

from shadowprefill.serve.sessions import comparable
from shadowprefill.serve.shadow_dispatch import ShadowDispatcher, ShadowTask, upstream_headers
from shadowprefill.shadow.jobs import common_prefix_length

BELIEF_SESSIONS = 100_000      # sessions whose content a server is believed to hold (LRU beyond)


class HttpInstance:
    """One upstream server of `model` at `url` (`served_model_name`: its `model` field)."""

    incremental = False
    role = "serve"
    prefill_tokens_per_s = 10_000.0

    def __init__(self, model: str, url: str, served_model_name: str, index: int = 0) -> None:
        self.model, self.url, self.served_model_name, self.index = model, url, served_model_name, index
        self.name = url
        self.down_until = 0.0
        self.last_error: str | None = None
        self.dead_retry_s = 5.0
        self.stats = {"shadow_submitted": 0, "shadow_completed": 0, "shadow_failed": 0, "shadow_timed_out": 0,
                      "shadow_superseded": 0,
                      "shadow_dropped_by_routed": 0, "shadow_deferred_busy": 0, "shadow_held_no_queue_metric": 0,
                      "shadow_dropped_by_plane": 0, "shadow_stream_submitted": 0, "shadow_stream_completed": 0,
                      "shadow_stream_skipped": 0, "shadow_aborted_by_routed": 0}
        self.queue_metric: bool | None = None      # whether /metrics exports vllm:num_requests_waiting
        self.block_size: int | None = None         # the server's KV block size (its /metrics), once read
        self.client = None
        self.dispatcher: ShadowDispatcher | None = None
        self._held: "OrderedDict[tuple[str, str], tuple]" = OrderedDict()   # session key -> comparable()
        self._queued: dict[str, float] = {}                                # request id -> uncached tokens
        self.view = None            # gateway.engine_view.EngineView when the server publishes KV events
        self.shadowed: set = set()  # sessions whose held content here came from a shadow of this manager

    def __repr__(self) -> str:
        return f"HttpInstance({self.model!r}, {self.url!r})"

    def start(self, client, poll_s: float, timeout_s: float, dead_retry_s: float) -> None:
        """Bind the shared HTTP client and start the shadow dispatcher (on the manager's event loop)."""
        self.client, self.dead_retry_s = client, dead_retry_s
        self.dispatcher = ShadowDispatcher(self, client, poll_s, timeout_s, dead_retry_s)
        self.dispatcher.start()

    # ------------------------------------------------------------------------------------------ health
    @property
    def alive(self) -> bool:
        return time.monotonic() >= self.down_until

    def healthy(self) -> bool:
        return self.alive

    def mark_down(self, error: str, retry_s: float | None = None) -> None:
        self.down_until = time.monotonic() + (self.dead_retry_s if retry_s is None else retry_s)
        self.last_error = error

    # -------------------------------------------------------------------------------------- placement
    def guess_cached(self, prompt, session) -> float:
        """Tokens of `prompt` this manager believes the server holds (what it last sent there)."""
        seq, per = comparable(getattr(prompt, "raw", prompt))
        held = self._held.get(session.key) if session is not None else None
        if held is not None and type(held[0]) is type(seq):
            return common_prefix_length(held[0], seq) / per
        return 0.0

    def _uncached(self, prompt, session, assume_cached: int | None) -> float:
        tokens = getattr(prompt, "tokens", {}).get(self.model)
        if tokens is not None and self.view is not None and not self.view.stale():   # engine truth
            cached = max(self.view.cached_tokens(prompt.tenant, tokens), float(assume_cached or 0))
            return max(0.0, len(tokens) - cached)
        prompt = getattr(prompt, "raw", prompt)
        seq, per = comparable(prompt)
        held = self._held.get(session.key) if session is not None else None
        cached = 0.0
        if held is not None and type(held[0]) is type(seq):
            cached = common_prefix_length(held[0], seq) / per
        if assume_cached:
            cached = max(cached, float(assume_cached))
        return max(0.0, len(seq) / per - cached)

    def estimate_prefill_s(self, prompt, session, assume_cached: int | None = None) -> float:
        pin = getattr(prompt, "pin", None)
        if pin is not None and pin is not self:           # the gateway decided on another instance
            return float("inf")
        queued = sum(self._queued.values())
        return (queued + self._uncached(prompt, session, assume_cached)) / self.prefill_tokens_per_s

    def holds(self, session_key: tuple[str, str], content) -> None:
        """Believe the server now caches `content` (a prompt + answer, or a shadow body) for the session."""
        self._held[session_key] = comparable(content)
        self.shadowed.discard(session_key)
        self._held.move_to_end(session_key)
        while len(self._held) > BELIEF_SESSIONS:
            self._held.popitem(last=False)

    # ------------------------------------------------------------------------------------------ calls
    def submit_call(self, ticket):
        """The upstream request of a routed call (`ticket.payload` = (path, body, headers)); the front door
        sends it. Counted as queued prefill until `answered(ticket)`."""
        path, body, headers = ticket.payload
        self._queued[ticket.request_id] = self._uncached(ticket.prompt, ticket.session, None)
        return self.client.build_request("POST", self.url + path, json={**body, "model": self.served_model_name},
                                         headers=headers)

    def answered(self, ticket) -> None:
        """The call's answer started (or the call ended): its prefill no longer queues here."""
        self._queued.pop(ticket.request_id, None)

    # ---------------------------------------------------------------------------------------- shadows
    def upsert_shadow(self, session, history, switch_prob: float, streamed: bool = False) -> None:
        """`history`: (path, body without `model`) of the request that makes this server hold the
        session's next-turn prefix; sent with `max_tokens: 1` at the lowest priority class, when admitted.
        Whether and where is the control plane's decision (`ControlPlane.plan_shadows`), made before.
        `streamed`: the prefix of a call still streaming (`serve.shadow_stream`), cut to whole blocks."""
        path, body = history
        self.dispatcher.submit(ShadowTask(session.key, path, {**body, "model": self.served_model_name},
                                          time.monotonic(), streamed))

    def extend_shadow(self, session, tokens) -> None:
        """Request-level shadows take the completed call (`incremental = False`): nothing to stream."""

    def cancel_shadow(self, session) -> None:
        if self.dispatcher is not None:
            self.dispatcher.drop(session.key)

    @staticmethod
    def headers(session_key: tuple[str, str]) -> dict[str, str]:
        return upstream_headers(session_key)
