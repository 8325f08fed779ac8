"""The project's `LLMEngine` behind an OpenAI-compatible HTTP API (the manager's built-in peer).

Endpoints: `POST /v1/completions` (prompt: text, token ids, or a one-element list of either),
`POST /v1/chat/completions` (the plain chat template of `serve.tokenizer`), `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus text under vLLM's metric names, see `serve.prometheus`).

Priority (vLLM semantics: an integer, lower runs first, default 0) maps onto the engine's classes:
`priority <= 0` -> routed, `0 < priority < shadow_priority` -> normal, `priority >= shadow_priority`
(default 1000, what the manager sends for shadow work) -> a shadow job: `LLMEngine.add_shadow` with the
session from the `X-Session-Id` header or the `user` field. Shadow work produces KV only, no token (paper
§3.1): the response has empty text, `finish_reason: "shadow"` and arrives when the engine has nothing left
to run for the job (so "one in-flight shadow per instance" in the manager means what it says). With
`--shadow-class normal` (or an engine in shadow mode "none") the lowest class becomes a normal-priority
request with `max_tokens` as given, i.e. what a vLLM server does with it.

`usage.prompt_tokens_details.cached_tokens` is the engine's `num_cached_tokens` (prefix-cache hit at
admission). `return_token_ids: true` adds `prompt_token_ids` and `token_ids` to each choice, as vLLM does.
The tenant (`X-Tenant` header) scopes the prefix cache. `kv_events` (`serve-engine --kv-events-config`, vLLM's
JSON) publishes the KV cache's contents as vLLM-format KV events (`serve.kv_publisher`). Sampling is greedy:
`serve.request_checks` rejects, with a 400 naming the field, every request field that would ask otherwise.
"""
from __future__ import annotations

import itertools
import json
import time
import uuid
from pathlib import Path

import torch
from aiohttp import web

from shadowprefill.engine import EngineConfig, LLMEngine
from shadowprefill.model import Llama, ModelConfig, load_checkpoint
from shadowprefill.serve import prometheus as prom
from shadowprefill.serve.engine_loop import EngineLoop
from shadowprefill.serve.kv_publisher import KVEventsPublisher
from shadowprefill.serve.request_checks import check_request
from shadowprefill.serve.tokenizer import ByteTokenizer, render_chat

DEFAULT_SHADOW_PRIORITY = 1000
TINY_MODELS = {"tiny": ModelConfig.tiny, "tiny_large": ModelConfig.tiny_large}


def load_model(model: str, seed: int = 0) -> Llama:
    """`tiny` / `tiny_large` (random weights from `seed`) or a local Hugging Face checkpoint directory."""
    if model in TINY_MODELS:
        return Llama(TINY_MODELS[model](), seed=seed)
    if Path(model).is_dir():
        return load_checkpoint(model, dtype=torch.float32)
    raise ValueError(f"model must be one of {sorted(TINY_MODELS)} or a checkpoint directory, got {model!r}")


def build_engine(model: str, *, num_blocks: int = 1024, block_size: int = 16, shadow_mode: str = "harvest-slo",
                 n_min: int = 16, seed: int = 0, token_budget: int = 2048, idle_cap_s: float | None = 0.25
                 ) -> LLMEngine:
    """An engine over `load_model(model)`. Defaults suit the tiny CPU models: a smaller `n_min` than the
    paper's 256 (appendix C) so short test histories get shadowed, and a shadow-only iteration capped at
    `idle_cap_s` instead of beta x TPOT SLO (a CPU forward of a few hundred tokens takes longer than the
    12.5 ms that rule gives, so idle shadow work would never fit; None restores the paper's rule)."""
    config = EngineConfig(num_blocks=num_blocks, block_size=block_size, shadow_mode=shadow_mode, n_min=n_min,
                          token_budget=token_budget, model_id=str(model), idle_cap_s=idle_cap_s)
    return LLMEngine(load_model(model, seed), config)


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


class EngineServer:
    """HTTP front of one engine; `app()` builds the aiohttp application (the engine thread starts with it)."""

    def __init__(self, engine: LLMEngine, model_name: str, shadow_priority: int = DEFAULT_SHADOW_PRIORITY,
                 shadow_class: str = "engine", shadow_wait_s: float = 60.0, kv_events: dict | None = None) -> None:
        if shadow_class not in ("engine", "normal"):
            raise ValueError(f"shadow_class must be 'engine' or 'normal', got {shadow_class!r}")
        self.engine = engine
        self.model_name = model_name
        self.shadow_priority = int(shadow_priority)
        self.shadow_class = shadow_class if engine.config.shadow_mode != "none" else "normal"
        self.tokenizer = ByteTokenizer(engine.vocab_size or 512)
        self.publisher = None if kv_events is None else KVEventsPublisher(**kv_events)
        self.loop = EngineLoop(engine, shadow_wait_s=shadow_wait_s, publisher=self.publisher)
        self._ids = itertools.count()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)

        async def lifecycle(_app):
            self.loop.start()
            yield
            self.loop.stop()
            if self.publisher is not None:
                self.publisher.close()
        app.cleanup_ctx.append(lifecycle)
        return app

    # ------------------------------------------------------------------------------------ endpoints
    async def health(self, request: web.Request) -> web.Response:
        if self.loop.error:
            return _error(500, f"engine loop crashed: {self.loop.error}", "internal_error")
        return web.Response(text="")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "owned_by": "shadowprefill",
             "max_model_len": self.engine.max_position}]})

    async def metrics(self, request: web.Request) -> web.Response:
        s, labels = self.loop.snapshot, {"model_name": self.model_name}
        text = "".join([
            prom.format_metric(prom.WAITING, s["waiting"], help_text="Requests waiting (routed + normal).",
                               labels=labels),
            prom.format_metric(prom.RUNNING, s["running"], help_text="Requests running.", labels=labels),
            prom.format_metric(prom.PREFIX_QUERIES, s["prompt_tokens"], "counter",
                               "Prompt tokens looked up in the prefix cache.", labels),
            prom.format_metric(prom.PREFIX_HITS, s["cached_prompt_tokens"], "counter",
                               "Prompt tokens served from the prefix cache.", labels),
            prom.format_metric(prom.CACHE_CONFIG, 1, help_text="KV cache configuration.",
                               labels={"block_size": str(self.engine.config.block_size),
                                       "num_gpu_blocks": str(self.engine.config.num_blocks)}),
            prom.format_metric("shadowprefill:shadow_jobs", s["shadow_jobs"], help_text="Shadow jobs held.",
                               labels=labels),
            prom.format_metric("shadowprefill:shadow_pending_tokens", s["shadow_pending_tokens"],
                               help_text="Whole-page shadow tokens not yet cached.", labels=labels),
            prom.format_metric("shadowprefill:shadow_tokens_total", s["shadow_tokens"], "counter",
                               "Tokens computed by shadow chunks.", labels),
            prom.format_metric("shadowprefill:iterations_total", s["iterations"], "counter",
                               "Engine iterations.", labels),
            prom.format_metric("shadowprefill:busy_seconds_total", s["busy_time_s"], "counter",
                               "Seconds spent executing iterations.", labels),
        ])
        return web.Response(text=text, content_type="text/plain")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        if isinstance(body, web.Response):
            return body
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            token_ids = list(prompt)
        else:
            return _error(400, "prompt must be a string or a list of token ids (batches are not supported)")
        return await self._generate(request, body, token_ids, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        if isinstance(body, web.Response):
            return body
        try:
            text = render_chat(body.get("messages"), bool(body.get("add_generation_prompt", True)),
                               bool(body.get("continue_final_message", False)))
        except ValueError as exc:
            return _error(400, str(exc))
        return await self._generate(request, body, self.tokenizer.encode(text), chat=True)

    # ------------------------------------------------------------------------------------- helpers
    async def _json(self, request: web.Request):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "request body must be JSON")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        if body.get("model") not in (None, self.model_name):
            return _error(404, f"model {body.get('model')!r} is not served here (serving {self.model_name!r})",
                          "not_found_error")
        return body

    async def _generate(self, request: web.Request, body: dict, token_ids: list[int], chat: bool):
        problem = check_request(body, greedy_only=True)
        if problem is not None:
            return _error(400, problem)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens", 16))
        priority = body.get("priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int):
            return _error(400, f"priority must be an integer, got {priority!r}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            return _error(400, f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        session = request.headers.get("X-Session-Id") or body.get("user") or None
        tenant = request.headers.get("X-Tenant", "")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        if priority >= self.shadow_priority and self.shadow_class == "engine":
            try:
                cached = await self.loop.add_shadow(session or rid, token_ids, tenant)
            except (ValueError, TypeError) as exc:
                return _error(400, str(exc))
            return web.json_response(self._response(rid, body, chat, token_ids, [], "shadow", cached))
        engine_priority = "routed" if priority <= 0 else "normal"
        try:
            outputs = await self.loop.add_request(rid, token_ids, max_tokens, engine_priority, session, tenant)
        except (ValueError, TypeError) as exc:
            return _error(400, str(exc))
        if body.get("stream"):
            return await self._stream(request, body, rid, chat, token_ids, outputs)
        try:
            while True:
                out = await outputs.get()
                if isinstance(out, Exception):
                    return _error(500, str(out), "internal_error")
                if out.finished:
                    break
        except BaseException:
            self.loop.abort(rid)
            raise
        return web.json_response(self._response(rid, body, chat, token_ids, out.token_ids,
                                                self._finish_reason(out), out.num_cached_tokens))

    async def _stream(self, request, body, rid, chat, token_ids, outputs) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        with_ids = bool(body.get("return_token_ids"))
        created, sent_ids, sent_text = int(time.time()), 0, ""
        try:
            while True:
                out = await outputs.get()
                if isinstance(out, Exception):
                    await resp.write(b'data: {"error": {"message": "engine loop crashed"}}\n\n')
                    break
                ids = out.token_ids
                text = self.tokenizer.decode(ids)
                delta, sent_text = text[len(sent_text):], text
                choice = {"index": 0, "finish_reason": self._finish_reason(out) if out.finished else None}
                if chat:
                    choice["delta"] = {"content": delta} if sent_ids else {"role": "assistant", "content": delta}
                else:
                    choice["text"] = delta
                if with_ids:
                    choice["token_ids"] = ids[sent_ids:]
                    if sent_ids == 0:
                        choice["prompt_token_ids"] = token_ids
                sent_ids = len(ids)
                chunk = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                         "created": created, "model": self.model_name, "choices": [choice]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                if out.finished:
                    opts = body.get("stream_options") or {}
                    if isinstance(opts, dict) and opts.get("include_usage"):
                        chunk = {"id": rid, "object": chunk["object"], "created": created,
                                 "model": self.model_name, "choices": [],
                                 "usage": self._usage(len(token_ids), len(ids), out.num_cached_tokens)}
                        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    break
            await resp.write(b"data: [DONE]\n\n")
        except BaseException:
            self.loop.abort(rid)
            raise
        return resp

    @staticmethod
    def _finish_reason(out) -> str:
        return "stop" if out.finish_reason == "stop" else "length"

    @staticmethod
    def _usage(prompt: int, completion: int, cached: int) -> dict:
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _response(self, rid, body, chat, prompt_ids, ids, finish, cached) -> dict:
        text = self.tokenizer.decode(ids)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish}
        if body.get("return_token_ids"):
            choice["prompt_token_ids"] = prompt_ids
            choice["token_ids"] = list(ids)
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": [choice],
                "usage": self._usage(len(prompt_ids), len(ids), cached)}


def make_engine_server(model: str = "tiny", **engine_kwargs) -> EngineServer:
    """An `EngineServer` over `build_engine(model, **engine_kwargs)`, named after the model."""
    server_kwargs = {k: engine_kwargs.pop(k) for k in ("shadow_priority", "shadow_class", "shadow_wait_s",
                                                       "model_name", "kv_events") if k in engine_kwargs}
    name = server_kwargs.pop("model_name", None) or (model if model in TINY_MODELS else Path(model).name)
    return EngineServer(build_engine(model, **engine_kwargs), name, **server_kwargs)
