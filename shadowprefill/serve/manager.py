"""The request-level shadow manager (paper §4 "vLLM prototype", appendix D.1): the HTTP front end of the
orchestration core.

The manager sits between agents and a fleet of OpenAI-compatible servers (vLLM or the built-in
`engine_server`; a server without vLLM's queue metric gets no shadows), several instances per model, each
an `HttpInstance` of the orchestration core (`cluster.manager.ClusterManager`: sessions, sticky placement
by lowest estimated prefill completion, the next-model prior, shadow targets); with a `gateway` config
section the live gateway (`serve.gateway_live`) feeds placement from the servers' own KV-cache events and
decides `"model": "auto"` calls. For each call of a session it routes (per-step router), lets the core
place it, forwards the request and streams the answer back unchanged. After the call completes the core
offers the call's prompt + response to the other models (all, or the top-1 / the gated ones by next-model
prior); the control plane (`ControlPlane.plan_shadows` via the gateway) decides which instance of each
gets it, if any, by expected benefit, and exactly those get it as lowest-priority shadow work with
`max_tokens: 1` (`ShadowDispatcher`), so a later switch finds its history in that model's prefix cache. With
`shadow.stream` (recommended for vLLM servers) the shadows also grow while the call runs: its prompt at once, then whole blocks of
prompt + output as the answer streams (`serve.shadow_stream`, §3.1). A session that
has been idle for `session_idle_s` ends: the prior learns its route and its state is freed.

Failure handling: connection failures before the first byte of an answer mark the instance down and fall
back to another instance of the routed model (a cold switch); with none left the client gets HTTP 503
naming the model. An upstream failure mid-stream ends the stream with an SSE `error` event. Every
upstream call has connect/read timeouts, so nothing hangs.

What the manager adds to an upstream request, and removes from the answer again: `stream_options:
{include_usage: true}` on streams (to read cached tokens; the usage chunk is dropped unless the client
asked for it), `return_token_ids: true` for token-id prompts (the response ids extend the shadow; the
fields are stripped unless asked for), the session headers `X-Session-Id` / `X-Tenant`, and
`cache_salt` when `tenant_cache_salt` is set.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
from aiohttp import web

from shadowprefill.cluster.manager import ClusterManager, NoLiveInstance
from shadowprefill.cluster.prior import SwitchPredictor
from shadowprefill.cluster.session import SessionState
from shadowprefill.serve.config import ManagerConfig
from shadowprefill.serve.gateway_live import GatewayPrompt, LiveGateway, option_dict
from shadowprefill.serve.metrics import ServeCall, summarize_by_policy
from shadowprefill.serve.sessions import LiveRouter, extends, shadow_body
from shadowprefill.serve.shadow_dispatch import upstream_headers
from shadowprefill.serve.shadow_stream import ShadowStream
from shadowprefill.serve.upstream import HttpInstance

_UPSTREAM_ERRORS = (httpx.TransportError, OSError)
log = logging.getLogger(__name__)


def error_response(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def _is_token_ids(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(t, int) and not isinstance(t, bool)
                                                            for t in prompt)


class _Answer:
    """What the manager reads from an answer while passing it through."""

    def __init__(self, on_first=None) -> None:
        self.text: list[str] = []
        self.ids: list[int] = []
        self.n_out = 0                                         # output tokens so far (ids, else text chunks)
        self.on_grow = None                                    # streamed shadows (serve.shadow_stream)
        self.usage: dict | None = None
        self.first_token: float | None = None
        self.on_first = on_first
        self.headers: dict[str, str] = {}                     # added to the client's response (decision)

    def read_choices(self, choices, chat: bool, streamed: bool) -> None:
        for ch in choices[:1]:                                 # n = 1: the first choice is the answer
            if chat:
                part = (ch.get("delta") or {}).get("content") if streamed else (ch.get("message") or {}).get(
                    "content")
            else:
                part = ch.get("text")
            ids = ch.get("token_ids") or []
            if part:
                self.text.append(part)
            self.ids.extend(ids)
            self.n_out += len(ids) if ids else bool(part)      # vLLM streams one token per text chunk
            if (part or ids) and self.first_token is None and streamed:
                self.first_token = time.monotonic()
                if self.on_first is not None:
                    self.on_first()
            if self.on_grow is not None and (part or ids):
                self.on_grow(self)

    @property
    def cached_tokens(self) -> int | None:
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        return details.get("cached_tokens") if self.usage else None


class Manager:
    """Routing, forwarding and the orchestration core over the configured fleet."""

    def __init__(self, config: ManagerConfig) -> None:
        if not isinstance(config, ManagerConfig):
            raise TypeError(f"config must be a ManagerConfig, got {type(config).__name__}")
        self.config = config
        self.instances = {m: [HttpInstance(e.model, e.url, e.served_model_name, i) for i, e in enumerate(eps)]
                          for m, eps in config.models.items()}
        self.router = LiveRouter(config.router, list(config.models))
        self.prior = SwitchPredictor()
        self.core = ClusterManager(self.instances, prior=self.prior, shadow_targets=config.shadow.targets,
                                   min_switch_prob=config.shadow.min_switch_prob, shadows=config.shadow.enabled)
        self.calls: list[ServeCall] = []
        self.gateway = LiveGateway(config, self.instances)
        self.client: httpx.AsyncClient | None = None
        self._expiry: asyncio.Task | None = None

    @property
    def sessions(self) -> dict[tuple[str, str], SessionState]:
        """The core's sessions, by (tenant, session id)."""
        return self.core.sessions

    def all_instances(self) -> list[HttpInstance]:
        return [i for insts in self.instances.values() for i in insts]

    # ---------------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        c = self.config
        timeout = httpx.Timeout(connect=c.connect_timeout_s, read=c.read_timeout_s, write=c.read_timeout_s,
                                pool=c.read_timeout_s)
        self.client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=512))
        for inst in self.all_instances():
            inst.start(self.client, c.shadow.poll_s, c.shadow.timeout_s, c.dead_retry_s)
        self.gateway.start(self.client)
        self._expiry = asyncio.get_running_loop().create_task(self._expire_sessions())

    async def close(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            try:
                await self._expiry
            except (asyncio.CancelledError, Exception):
                pass
        for inst in self.all_instances():
            if inst.dispatcher is not None:
                await inst.dispatcher.stop()
        await self.gateway.close()
        if self.client is not None:
            await self.client.aclose()

    # ------------------------------------------------------------------------------------ helpers
    def end_idle_sessions(self, now: float | None = None) -> int:
        """End every session with no call in flight for `session_idle_s` (the prior learns its route);
        returns how many ended."""
        now = time.monotonic() if now is None else now
        idle = [s for s in self.core.sessions.values()
                if s.calls_in_flight == 0 and now - s.last_active >= self.config.session_idle_s]
        for s in idle:
            self.core.end_session(s.session_id, s.tenant)
        return len(idle)

    async def _expire_sessions(self) -> None:
        period = min(60.0, self.config.session_idle_s / 4)
        while True:
            await asyncio.sleep(period)
            self.end_idle_sessions()

    async def wait_shadows_idle(self, timeout: float) -> bool:
        """True once no instance has a pending or in-flight shadow (within `timeout` seconds)."""
        end = time.monotonic() + timeout
        for inst in self.all_instances():
            if not await inst.dispatcher.idle(max(0.0, end - time.monotonic())):
                return False
        return True

    def summary(self, tenant: str | None = None) -> dict:
        calls = [c for c in self.calls if tenant is None or c.tenant == tenant]
        sticky: dict[int, int] = {}
        for s in self.core.sessions.values():
            for inst in s.sticky.values():
                sticky[id(inst)] = sticky.get(id(inst), 0) + 1
        gw = self.gateway.status()
        return {"policies": summarize_by_policy(calls),
                "instances": {i.url: {"model": i.model, "alive": i.alive, "sessions": sticky.get(id(i), 0),
                                      "queue_metric": i.queue_metric,
                                      "last_error": i.last_error, **gw[i.url], **i.stats}
                              for i in self.all_instances()}}

    # ------------------------------------------------------------------------------------ forward
    async def forward(self, request: web.Request, kind: str, body: dict, tenant: str, session_id: str | None,
                      shadow_enabled: bool = True) -> web.StreamResponse:
        """Route, forward and pass the answer through; afterwards submit the shadows."""
        chat = kind == "chat"
        path = "/v1/chat/completions" if chat else "/v1/completions"
        prompt = body.get("messages") if chat else body.get("prompt")
        if not chat and isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]
        state = self.core.session(session_id, tenant, shadow_enabled=shadow_enabled) if session_id else None
        routed = await self._route(request, body, kind, prompt, state, tenant)
        if isinstance(routed, web.Response):
            return routed
        model, placed_prompt, decision, auto = routed
        stream = bool(body.get("stream"))
        opts = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
        client_usage = bool(opts.get("include_usage"))
        strip_ids = _is_token_ids(prompt) and not body.get("return_token_ids")
        upstream = dict(body)
        if stream:
            upstream["stream_options"] = {**opts, "include_usage": True}
        if strip_ids:
            upstream["return_token_ids"] = True
        upstream["model"] = model
        if self.config.tenant_cache_salt and tenant:
            upstream["cache_salt"] = tenant
        headers = upstream_headers(state.key) if state else {"X-Tenant": tenant}
        call_index, is_switch = 0, False
        arrival = time.monotonic()
        if state is not None:
            call_index = state.num_calls
            is_switch = state.current_model is not None and state.current_model != model
            if not extends(prompt, state.last_prompt, state.last_response):
                state.append_only = False
            state.calls_in_flight += 1
            state.last_active = arrival
        answer = _Answer()
        status, error, out, history, ticket, rec, plan = 200, None, None, None, None, None, None
        streamer = None
        try:
            try:
                ticket = self.core.submit_call(session_id, None, model, placed_prompt, tenant=tenant,
                                               payload=(path, upstream, headers))
            except NoLiveInstance:
                pass
            placed = ticket is not None
            if placed and state is not None and ticket.deferred and self.config.shadow.stream and state.append_only:
                streamer = self._stream_shadows(state, ticket, kind, path, prompt, answer, stream)
            while placed:
                rec = self._describe(ticket.instance, answer, tenant, session_id, placed_prompt, state, decision, auto)
                status, error, out, retry = await self._send(request, ticket, answer, stream, chat, client_usage,
                                                             strip_ids)
                if not retry:
                    break
                placed = self.core.fail_over(ticket)         # cold fallback to another instance
            if not placed:
                down = [f"{i.url} ({i.last_error})" for i in self.instances[model]]
                status, error = 503, f"model {model!r} is unavailable: no live instance; {'; '.join(down)}"
                out = error_response(503, error, "service_unavailable")
            finish = time.monotonic()
            usage = answer.usage or {}
            if status != 200 and error is None:
                error = f"upstream HTTP {status}"
            self.calls.append(ServeCall(
                session_id=session_id or "", call_index=call_index, tenant=tenant, model=model,
                instance=ticket.instance.url if placed else "", is_switch=is_switch,
                policy=("harvest" if self.config.shadow.enabled and state.shadow_enabled else "no-shadow")
                if state else "background",
                arrival=arrival, first_token=answer.first_token, finish=finish,
                prompt_tokens=usage.get("prompt_tokens"), cached_tokens=answer.cached_tokens,
                output_tokens=usage.get("completion_tokens"), stream=stream, status=status, error=error))
            if rec is not None:
                gw = self.gateway
                rec["call"] = len(self.calls) - 1
                gw.record(rec)
                if status == 200 and error is None:
                    ttft = (answer.first_token - arrival) if answer.first_token is not None else \
                        (finish - arrival if usage.get("completion_tokens") == 1 else None)
                    try:
                        gw.learn(rec, answer.cached_tokens, usage.get("prompt_tokens"), ttft, ticket.instance,
                                 started=arrival)
                    except Exception:  # noqa: BLE001 - learning never fails a call
                        log.exception("gateway learning failed")
            if streamer is not None:
                await streamer.close()
            if state is not None and status == 200 and error is None:
                response = answer.ids if _is_token_ids(prompt) else "".join(answer.text)
                history = self._completed(state, ticket, kind, path, prompt, response)
                if history is not None and ticket.deferred:
                    try:
                        plan = await self.gateway.plan_shadows(state, ticket.deferred, history[1],
                                                               self.config.shadow.cost_ratio)
                    except Exception:  # noqa: BLE001 - a planning failure: the core's shadow homes, as before
                        log.exception("shadow planning failed; the core's shadow homes")
        finally:                        # also when the client went away: the session may expire, the core forgets
            if streamer is not None:
                streamer.abandon()
            if state is not None:
                state.calls_in_flight -= 1
                state.last_active = time.monotonic()
            if ticket is not None:
                self.core.finish_call(ticket, history if plan is None else None)
                if plan is not None:
                    self._dispatch_shadows(state, plan, history, rec, out)
        return out

    def _stream_shadows(self, state: SessionState, ticket, kind: str, path: str, prompt, answer: _Answer,
                        stream: bool) -> ShadowStream:
        """Streamed shadows of this call (§3.1, `serve.shadow_stream`): its prompt now, and (a streamed
        answer) prompt + output so far every `shadow.stream_tokens` output tokens."""
        ids = _is_token_ids(prompt)

        def body_of(response):
            return self._shadow_request(state, kind, path, prompt, response if response is not None else
                                        ([] if ids else ""))

        s = ShadowStream(self, state, ticket.deferred, body_of, self.config.shadow.stream_tokens)
        s.start()
        if stream:
            answer.on_grow = lambda a: s.grow(a.n_out, lambda: list(a.ids) if ids else "".join(a.text))
        return s

    def _dispatch_shadows(self, state: SessionState, plan: list, history, rec: dict | None, out) -> None:
        """Carry out the control plane's shadow decision: exactly the chosen (model, instance) get the
        history; a rejected instance's pending shadow of the session is dropped (its content is moot)."""
        by_url = {i.url: i for i in self.all_instances()}
        for v in plan:
            inst = by_url[v.site]
            if v.chosen:
                inst.upsert_shadow(state, history, v.switch_prob)
                state.shadow_on.add(inst)
                self.core.shadow_jobs_created += 1
            elif inst.dispatcher is not None and inst.dispatcher.pending.pop(state.key, None) is not None:
                inst.stats["shadow_dropped_by_plane"] += 1
        if rec is None:
            return
        rec["shadows"] = [{"model": v.model_id, "instance": v.site, "benefit_s": round(v.benefit_s, 6),
                           "cached_tokens": v.cached_tokens, "warm_tokens": v.warm_tokens} for v in plan if v.chosen]
        rec["shadows_rejected"] = [{"model": v.model_id, "instance": v.site, "reason": v.reason}
                                   for v in plan if not v.chosen]
        if isinstance(out, web.Response) and "X-Gateway-Decision" in out.headers:   # not sent yet (no stream)
            out.headers["X-Gateway-Decision"] += "; shadows=" + (
                ",".join(f"{s['model']}@{s['instance']}" for s in rec["shadows"]) or "none")

    async def _route(self, request: web.Request, body: dict, kind: str, prompt, state, tenant: str):
        """(model, prompt to place, gateway decision or None, auto?) of a call, or an error response.
        `"model": "auto"` with a gateway section: the control plane's choice (a decision failure falls back
        to the first gateway model); otherwise the per-step router's."""
        gw, decision, by_site, tokens, pin = self.gateway, None, None, {}, None
        key = state.key if state else None
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens", 16))
        max_tokens = max_tokens if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) else 16
        auto = body.get("model") == "auto" and self.config.gateway is not None and "auto" not in self.config.models
        try:
            if auto:
                for m in self.config.gateway.models:
                    tokens[m] = await gw.tokens(m, kind, prompt, key)
                decision, by_site = gw.decide_auto(tenant, {m: t for m, t in tokens.items() if t}, request.headers,
                                                   max_tokens)
        except ValueError as exc:                            # a malformed gateway header
            return error_response(400, str(exc), "invalid_request_error")
        except Exception:  # noqa: BLE001 - a decision failure falls back to plain routing
            log.exception("gateway decision failed; plain routing")
            decision = None
        if auto and decision is not None and decision.chosen is not None:
            model, pin = decision.chosen.model_id, by_site[decision.chosen.site]
        elif auto:
            if decision is not None:                         # nothing feasible: say so
                why = "; ".join(sorted({o.reason for o in decision.options if o.reason}))
                return error_response(400, f"model auto: no (model, instance, action) meets the constraints: {why}",
                                      "invalid_request_error")
            model = next(iter(self.config.gateway.models))
        else:
            try:
                model = self.router.route(state, body.get("model"))
            except ValueError as exc:
                return error_response(404, str(exc), "not_found_error")
        try:
            if model not in tokens and any(i.view is not None for i in self.instances[model]):
                tokens[model] = await gw.tokens(model, kind, prompt, key)
        except Exception:  # noqa: BLE001 - no tokens: the guess answers
            log.exception("tokenization failed")
        return model, GatewayPrompt(prompt, tenant, {m: t for m, t in tokens.items() if t}, pin), decision, auto

    def _describe(self, inst, answer: _Answer, tenant: str, session_id, prompt: GatewayPrompt, state, decision,
                  auto: bool) -> dict | None:
        """The decision record of a call about to go to `inst` (also the `X-Gateway-Decision` header)."""
        try:
            gw = self.gateway
            ids = prompt.tokens.get(inst.model)
            predicted, source = gw.predicted_cached(inst, tenant, ids, prompt, state)
            chosen = decision.chosen if decision is not None and decision.chosen is not None else None
            if chosen is not None and chosen.site == inst.url:
                action, latency = chosen.action, chosen.latency_s
            else:
                action = "reuse" if predicted > 0 else "reprefill"
                n = len(ids) if ids else len(prompt)
                latency = gw.fit.prefill_time_at(inst.url, inst.model, max(n, predicted), predicted)
            if action == "reuse" and state is not None and state.key in inst.shadowed:
                action = "shadow"                        # the reused prefix is one this manager's shadow warmed
            rec = {"tenant": tenant, "session": session_id or "", "model": inst.model, "instance": inst.url,
                   "action": action, "predicted_cached_tokens": int(predicted),
                   "predicted_latency_s": round(float(latency), 6), "source": source, "auto": auto,
                   "reported_cached_tokens": None, "shadows": []}
            if auto and decision is not None:
                rec["options"] = [option_dict(o) for o in decision.options]
            answer.headers = {"X-Gateway-Decision": "; ".join(
                f"{k}={rec[k]}" for k in ("model", "instance", "action", "predicted_cached_tokens",
                                          "predicted_latency_s", "source"))}
            return rec
        except Exception:  # noqa: BLE001 - a registry failure: plain routing, no decision record
            log.exception("gateway decision record failed")
            return None

    async def _send(self, request: web.Request, ticket, answer: _Answer, stream: bool, chat: bool,
                    client_usage: bool, strip_ids: bool):
        """Send the call to its instance and pass the answer through: (status, error, response, retry);
        retry: the instance failed before answering (it is marked down)."""
        inst, resp = ticket.instance, None
        answer.on_first = lambda: inst.answered(ticket)
        try:
            resp = await self.client.send(ticket.request, stream=True)
            if stream and resp.status_code == 200:
                return 200, None, await self._pass_stream(request, resp, answer, chat, client_usage, strip_ids), False
            out = await self._pass_body(resp, answer, chat, strip_ids)
            return resp.status_code, None, out, False
        except _UPSTREAM_ERRORS as exc:
            inst.mark_down(repr(exc), self.config.dead_retry_s)
            self.gateway.dead(inst, repr(exc))
            if isinstance(exc, _MidStreamError):
                return 502, str(exc), exc.response, False
            return 200, None, None, True
        finally:
            inst.answered(ticket)
            if resp is not None:
                await resp.aclose()

    async def _pass_body(self, resp: httpx.Response, answer: _Answer, chat: bool, strip_ids: bool) -> web.Response:
        data = await resp.aread()
        if resp.status_code == 200:
            try:
                obj = json.loads(data)
            except ValueError:
                obj = None
            if isinstance(obj, dict):
                answer.usage = obj.get("usage")
                answer.read_choices(obj.get("choices") or [], chat, streamed=False)
                if strip_ids:
                    for ch in obj.get("choices") or []:
                        ch.pop("token_ids", None)
                        ch.pop("prompt_token_ids", None)
                    obj.pop("prompt_token_ids", None)
                    data = json.dumps(obj).encode()
        return web.Response(body=data, status=resp.status_code, headers=answer.headers,
                            content_type=resp.headers.get("content-type", "application/json").split(";")[0])

    async def _pass_stream(self, request: web.Request, resp: httpx.Response, answer: _Answer, chat: bool,
                           client_usage: bool, strip_ids: bool) -> web.StreamResponse:
        """Forward SSE events as they arrive; headers go out with the first event, so an upstream that
        dies before answering can still be replaced by another instance."""
        out: web.StreamResponse | None = None
        buf = b""
        try:
            async for piece in resp.aiter_raw():
                buf += piece
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    event = self._filter_event(event, answer, chat, client_usage, strip_ids)
                    if event is None:
                        continue
                    if out is None:
                        out = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                          "Cache-Control": "no-cache", **answer.headers})
                        await out.prepare(request)
                    await out.write(event + b"\n\n")
        except _UPSTREAM_ERRORS as exc:
            if out is None:
                raise
            msg = json.dumps({"error": {"message": f"upstream failed mid-stream: {exc!r}",
                                        "type": "upstream_error", "code": 502}})
            await out.write(b"data: " + msg.encode() + b"\n\n")
            await out.write_eof()
            raise _MidStreamError(f"upstream failed mid-stream: {exc!r}", out) from exc
        if out is None:                                      # an empty 200 stream
            raise httpx.RemoteProtocolError("upstream closed the stream without an event")
        if buf.strip():
            await out.write(buf)
        await out.write_eof()
        return out

    @staticmethod
    def _filter_event(event: bytes, answer: _Answer, chat: bool, client_usage: bool, strip_ids: bool):
        text = event.strip()
        if not text.startswith(b"data:"):
            return event
        payload = text[5:].strip()
        if payload == b"[DONE]":
            return event
        try:
            obj = json.loads(payload)
        except ValueError:
            return event
        if not isinstance(obj, dict):
            return event
        choices = obj.get("choices") or []
        answer.read_choices(choices, chat, streamed=True)
        if obj.get("usage"):
            answer.usage = obj["usage"]
            if not choices and not client_usage:
                return None                                  # the usage chunk only the manager asked for
        if strip_ids or (obj.get("usage") and not client_usage):
            for ch in choices:
                ch.pop("token_ids", None)
                ch.pop("prompt_token_ids", None)
            obj.pop("prompt_token_ids", None)
            if not client_usage and "usage" in obj:
                obj.pop("usage")
            return b"data: " + json.dumps(obj).encode()
        return event

    # ------------------------------------------------------------------------------------ shadows
    def _completed(self, state: SessionState, ticket, kind: str, path: str, prompt, response):
        """A call of `state` completed: its instance now holds prompt + response; returns the shadow
        request (path, body) that makes another model's server hold the next call's prefix (None: none)."""
        ticket.instance.holds(state.key, shadow_body(kind, prompt, response, True))
        state.last_prompt, state.last_response = prompt, response
        return self._shadow_request(state, kind, path, prompt, response)

    def _shadow_request(self, state: SessionState, kind: str, path: str, prompt, response):
        """(path, body) of the shadow request for prompt + response (None: no shadow form)."""
        base = shadow_body(kind, prompt, response, state.append_only)
        if base is None:
            return None
        body = {**base, "max_tokens": 1, "priority": self.config.shadow.priority, "stream": False}
        if self.config.tenant_cache_salt and state.tenant:
            body["cache_salt"] = state.tenant
        return (path, body)


class _MidStreamError(httpx.TransportError):
    """The upstream died after the answer started: the client already has the headers and an error event."""

    def __init__(self, message: str, response: web.StreamResponse) -> None:
        super().__init__(message)
        self.response = response
