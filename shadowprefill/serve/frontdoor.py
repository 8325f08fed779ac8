"""The manager's own OpenAI-compatible HTTP front door (one port): agents point their client at it.

- `POST /v1/completions`, `POST /v1/chat/completions`: forwarded through `Manager.forward`.
- Session identity: the `X-Session-Id` header, else the request's `user` field; a request with neither is
  forwarded statelessly (no stickiness, no shadow), e.g. background traffic. `X-Shadow: off` opts a
  session out of shadows (the replay's "without shadow" runs).
- Tenants: with `api_keys` configured every request (except `/health`) needs `Authorization: Bearer KEY`
  with a configured key, else HTTP 401; the key's tenant scopes the session, so one tenant's sessions
  never receive shadows built from another's prompts.
- `GET /v1/models`, `GET /health`, and for operators `GET /manager/summary` (per-policy call metrics and
  per-instance shadow counters, restricted to the caller's tenant), `GET /manager/calls` (per-call
  records, same restriction), `POST /manager/wait-shadows?timeout=S` (block until no shadow is pending),
  `GET /manager/decisions` (the gateway's per-call decision records, same restriction) and `GET /metrics`
  (Prometheus: decisions by action, cached-token prediction error, registry entries, event lag, stale
  instances; fleet-wide, so behind the API key like every path but `/health`).
- `"model": "auto"` (with a config `gateway` section): the gateway decides model and instance per call;
  `X-Gateway-Min-Quality` / `X-Gateway-Max-Latency-S` override the config's constraints for one call.
"""
from __future__ import annotations

import json

from aiohttp import web

from shadowprefill.serve.config import ManagerConfig
from shadowprefill.serve.manager import Manager, error_response
from shadowprefill.serve.request_checks import check_request

MANAGER_KEY = web.AppKey("manager", Manager)
TENANT_KEY = web.RequestKey("tenant", str) if hasattr(web, "RequestKey") else "tenant"


def _tenant_of(request: web.Request, api_keys: dict[str, str]) -> str | None:
    if not api_keys:
        return ""
    auth = request.headers.get("Authorization", "")
    if not auth.startswith("Bearer "):
        return None
    return api_keys.get(auth[len("Bearer "):].strip())


def make_manager_app(config: ManagerConfig) -> web.Application:
    """The aiohttp application of a manager over `config` (the manager starts and stops with the app)."""
    manager = Manager(config)

    @web.middleware
    async def auth(request: web.Request, handler):
        if request.path == "/health":
            return await handler(request)
        tenant = _tenant_of(request, config.api_keys)
        if tenant is None:
            return error_response(401, "missing or invalid API key (Authorization: Bearer KEY)",
                                  "authentication_error")
        request[TENANT_KEY] = tenant
        return await handler(request)

    async def forward(request: web.Request, kind: str) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error_response(400, "request body must be JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object", "invalid_request_error")
        if kind == "chat" and not isinstance(body.get("messages"), list):
            return error_response(400, "messages must be a list", "invalid_request_error")
        if kind == "completions" and "prompt" not in body:
            return error_response(400, "prompt is required", "invalid_request_error")
        problem = check_request(body, greedy_only=False)
        if problem is not None:
            return error_response(400, problem, "invalid_request_error")
        session_id = request.headers.get("X-Session-Id") or body.get("user") or None
        if session_id is not None and not isinstance(session_id, str):
            return error_response(400, "user / X-Session-Id must be a string", "invalid_request_error")
        shadow = request.headers.get("X-Shadow", "on").lower() not in ("off", "0", "false", "no")
        return await manager.forward(request, kind, body, request[TENANT_KEY], session_id, shadow)

    async def completions(request):
        return await forward(request, "completions")

    async def chat(request):
        return await forward(request, "chat")

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model", "owned_by": "shadowprefill"}
                                                            for m in config.models]})

    async def health(request):
        return web.Response(text="")

    async def summary(request):
        return web.json_response(manager.summary(request[TENANT_KEY]))

    async def calls(request):
        tenant = request[TENANT_KEY]
        return web.json_response([c.as_dict() for c in manager.calls if c.tenant == tenant])

    async def decisions(request):
        tenant = request[TENANT_KEY]
        return web.json_response([d for d in manager.gateway.decisions if d["tenant"] == tenant])

    async def metrics(request):
        return web.Response(text=manager.gateway.metrics_text(), content_type="text/plain")

    async def wait_shadows(request):
        try:
            timeout = float(request.query.get("timeout", "30"))
        except ValueError:
            return error_response(400, "timeout must be a number", "invalid_request_error")
        return web.json_response({"idle": await manager.wait_shadows_idle(timeout)})

    app = web.Application(middlewares=[auth], client_max_size=64 * 2**20)
    app[MANAGER_KEY] = manager
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/manager/summary", summary)
    app.router.add_get("/manager/calls", calls)
    app.router.add_post("/manager/wait-shadows", wait_shadows)
    app.router.add_get("/manager/decisions", decisions)
    app.router.add_get("/metrics", metrics)

    async def lifecycle(_app):
        await manager.start()
        yield
        await manager.close()
    app.cleanup_ctx.append(lifecycle)
    return app
