"""`shadowprefill serve-engine | serve-manager | replay` (wired into `shadowprefill.cli` by `register`).

    shadowprefill serve-engine --model tiny --port 8001            # built-in engine server
    shadowprefill serve-manager --config manager.json              # the manager's front door
    shadowprefill replay --manager http://127.0.0.1:8000 --sessions sessions.jsonl [--api-key KEY]
"""
from __future__ import annotations

import asyncio
import json
import socket
import sys
from pathlib import Path

from shadowprefill.usage import Parser, UsageError, nonneg_float, nonneg_int, port, positive_int, run_cli, user_input


def check_bind(host: str, port_: int) -> None:
    """Fail now, naming them, if `host`:`port_` cannot be bound (in use, no such address)."""
    if port_ == 0:
        return
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)      # as the server binds
            s.bind((host, port_))
    except OSError as exc:
        raise UsageError(f"cannot listen on {host}:{port_}: {exc.strerror or exc}") from None


def parse_model_map(text: str | None) -> dict | None:
    """`recorded=served,...` -> {recorded: served}."""
    if not text:
        return None
    out = {}
    for pair in text.split(","):
        recorded, sep, served = (x.strip() for x in pair.partition("="))
        if not sep or not recorded or not served:
            raise ValueError(f"--model-map: {pair!r} is not RECORDED=SERVED")
        out[recorded] = served
    return out


def check_manager(url: str, api_key: str | None) -> None:
    """The manager URL answers `GET /v1/models` (a ValueError naming it otherwise)."""
    import httpx
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--manager must be an http(s) URL, got {url!r}")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=10.0).raise_for_status()
    except httpx.HTTPError as exc:
        raise ValueError(f"--manager {url}: GET /v1/models failed ({exc})") from None


def _serve_engine(args) -> int:
    from shadowprefill.serve.app_runner import serve_forever
    from shadowprefill.serve.engine_server import make_engine_server

    from shadowprefill.serve.kv_publisher import parse_events_config

    with user_input():
        check_bind(args.host, args.port)
        events = None if args.kv_events_config is None else parse_events_config(args.kv_events_config)
        server = make_engine_server(args.model, num_blocks=args.num_blocks, block_size=args.block_size,
                                    shadow_mode=args.shadow_mode, n_min=args.n_min, seed=args.seed,
                                    shadow_priority=args.shadow_priority, shadow_class=args.shadow_class,
                                    model_name=args.served_model_name, kv_events=events)
    serve_forever(server.app, args.host, args.port)
    return 0


def _serve_manager(args) -> int:
    from shadowprefill.serve.app_runner import serve_forever
    from shadowprefill.serve.config import ManagerConfig
    from shadowprefill.serve.frontdoor import make_manager_app

    with user_input("--config"):
        text = Path(args.config).read_text()
    with user_input(f"--config {args.config}"):
        config = ManagerConfig.from_dict(json.loads(text))
        host = args.host or config.host
        port_ = args.port if args.port is not None else config.port
        if isinstance(port_, bool) or not isinstance(port_, int) or not 0 <= port_ <= 65535:
            raise ValueError(f"port must be an int in [0, 65535], got {port_!r}")
    check_bind(host, port_)
    print(startup_report(config, host, port_), flush=True)
    serve_forever(lambda: make_manager_app(config), host, port_)
    return 0


def startup_report(config, host: str, port_: int, timeout: float = 2.0) -> str:
    """What `serve-manager` prints before it serves: the config it read, each model's instances and what
    was checked about each (reachable, queue metric for shadow admission, /tokenize, KV events)."""
    import httpx

    from shadowprefill.serve import prometheus as prom
    lines = [f"serve-manager on http://{host}:{port_}: config checked; models {sorted(config.models)}; "
             f"router {config.router.get('type')}; shadows {'on' if config.shadow.enabled else 'off'} "
             f"(targets {config.shadow.targets}); tenants {len(set(config.api_keys.values())) or 1}; "
             f"tenant cache_salt {'on' if config.tenant_cache_salt else 'off'}; "
             f"gateway {'on: model auto over ' + str(sorted(config.gateway.models)) if config.gateway else 'off'}"]
    for model, eps in config.models.items():
        for ep in eps:
            notes = []
            try:
                ok = httpx.get(ep.url + "/health", timeout=timeout).status_code == 200
                notes.append("reachable" if ok else "health check failed")
                parsed = prom.parse_metrics(httpx.get(ep.url + "/metrics", timeout=timeout).text)
                notes.append("queue metric ok" if prom.WAITING in parsed else
                             f"no {prom.WAITING}: shadows to it are held")
                r = httpx.post(ep.url + "/tokenize", json={"model": ep.served_model_name, "prompt": "a"},
                               timeout=timeout)
                notes.append("/tokenize ok" if r.status_code == 200 else "no /tokenize: token ids from requests only")
            except httpx.HTTPError as exc:
                notes.append(f"unreachable now ({type(exc).__name__}); calls fall back to other instances")
            notes.append(f"KV events on {ep.kv_events.endpoint}" if ep.kv_events else
                         "no KV events: cache state guessed from what was sent")
            lines.append(f"  {model}: {ep.url} (served as {ep.served_model_name!r}): " + "; ".join(notes))
    return "\n".join(lines)


def _replay(args) -> int:
    from shadowprefill.cluster.traces import load_sessions
    from shadowprefill.serve.replay import replay, switch_table

    with user_input():
        if args.min_gap_s > args.max_gap_s:
            raise ValueError(f"--min-gap-s {args.min_gap_s} must be <= --max-gap-s {args.max_gap_s}")
        model_map = parse_model_map(args.model_map)
        sessions = load_sessions(args.sessions)
        if model_map is not None:
            missing = {c.model for s in sessions for c in s.calls} - set(model_map)
            if missing:
                raise ValueError(f"--model-map lacks the recorded model(s) {sorted(missing)} of {args.sessions}")
        check_manager(args.manager, args.api_key)
    result = asyncio.run(replay(
        args.manager, sessions, api_key=args.api_key, model_map=model_map,
        vocab_size=args.vocab_size, max_output_tokens=args.max_output_tokens,
        max_prompt_tokens=args.max_prompt_tokens, concurrency=args.concurrency, workers=args.background_workers,
        background_prompt_tokens=args.background_prompt_tokens, min_gap_s=args.min_gap_s,
        max_gap_s=args.max_gap_s))
    print(switch_table(result["summary"]))
    print(f"background requests: {result['background_requests']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")
    return 0


def vocab_size(text: str) -> int:
    """--vocab-size: recorded ids map into [10, vocab), so at least 11."""
    import argparse
    value = nonneg_int(text)
    if value < 11:
        raise argparse.ArgumentTypeError(f"must be >= 11 (ids map into [10, vocab)), got {text!r}")
    return value


def register(subparsers) -> None:
    """Add serve-engine, serve-manager and replay to a `shadowprefill` sub-command parser."""
    p = subparsers.add_parser("serve-engine", help="serve the built-in engine over OpenAI-compatible HTTP")
    p.add_argument("--model", default="tiny", help="tiny | tiny_large | a local HF checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=port, default=8001, help="port to listen on")
    p.add_argument("--served-model-name", default=None, help="model name in the API (default: --model)")
    p.add_argument("--num-blocks", type=positive_int, default=1024, help="KV pages in the engine's pool")
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV page")
    p.add_argument("--shadow-mode", default="harvest-slo", choices=["none", "harvest", "harvest-slo", "eager"],
                   help="the engine's shadow controller policy (paper Table 2)")
    p.add_argument("--n-min", type=positive_int, default=16, help="smallest shadow chunk in tokens (paper: 256)")
    p.add_argument("--seed", type=nonneg_int, default=0, help="random-weight seed of the tiny models")
    p.add_argument("--shadow-priority", type=int, default=1000,
                   help="requests with priority >= this are shadow work")
    p.add_argument("--shadow-class", default="engine", choices=["engine", "normal"],
                   help="engine: shadow requests become engine shadow jobs; normal: normal-priority requests")
    p.add_argument("--kv-events-config", default=None,
                   help="publish KV-cache events as vLLM does: JSON like vLLM's --kv-events-config")
    p.set_defaults(func=_serve_engine)

    p = subparsers.add_parser("serve-manager", help="run the shadow manager's OpenAI-compatible front door")
    p.add_argument("--config", required=True, help="JSON config (see shadowprefill.serve.config)")
    p.add_argument("--host", default=None, help="address to listen on (default: the config's host)")
    p.add_argument("--port", type=port, default=None, help="port to listen on (default: the config's port)")
    p.set_defaults(func=_serve_manager)

    p = subparsers.add_parser("replay", help="replay sessions through a manager, with and without shadow")
    p.add_argument("--manager", required=True, help="manager base URL")
    p.add_argument("--sessions", required=True, help="JSONL session file (shadowprefill.cluster.traces)")
    p.add_argument("--api-key", default=None, help="the manager's API key, sent as Authorization: Bearer KEY")
    p.add_argument("--model-map", default=None, help="recorded=served,... (default: by order of appearance)")
    p.add_argument("--vocab-size", type=vocab_size, default=512, help="recorded ids are mapped into [10, vocab)")
    p.add_argument("--max-output-tokens", type=positive_int, default=16, help="output tokens per call")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=2048, help="a session stops at a longer prompt")
    p.add_argument("--concurrency", type=positive_int, default=2, help="sessions in flight")
    p.add_argument("--background-workers", type=nonneg_int, default=1, help="clients sending normal traffic")
    p.add_argument("--background-prompt-tokens", type=positive_int, default=128,
                   help="prompt tokens of each background request")
    p.add_argument("--min-gap-s", type=nonneg_float, default=0.5, help="shortest tool gap between a session's calls")
    p.add_argument("--max-gap-s", type=nonneg_float, default=2.0, help="longest tool gap between a session's calls")
    p.add_argument("--out", default=None, help="write the full result JSON here")
    p.set_defaults(func=_replay)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="shadowprefill")
    register(parser.add_subparsers(dest="command", required=True))
    return run_cli(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
