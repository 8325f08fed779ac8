"""`shadowprefill serve-engine | serve-manager | replay` (wired into `shadowprefill.cli` by `register`).

    shadowprefill serve-engine --model tiny --port 8001            # built-in engine server
    shadowprefill serve-manager --config manager.json              # the manager's front door
    shadowprefill replay --manager http://127.0.0.1:8000 --sessions sessions.jsonl [--api-key KEY]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys


def _serve_engine(args) -> int:
    from shadowprefill.serve.app_runner import serve_forever
    from shadowprefill.serve.engine_server import make_engine_server

    server = make_engine_server(args.model, num_blocks=args.num_blocks, block_size=args.block_size,
                                shadow_mode=args.shadow_mode, n_min=args.n_min, seed=args.seed,
                                shadow_priority=args.shadow_priority, shadow_class=args.shadow_class,
                                model_name=args.served_model_name)
    serve_forever(server.app, args.host, args.port)
    return 0


def _serve_manager(args) -> int:
    from shadowprefill.serve.app_runner import serve_forever
    from shadowprefill.serve.config import ManagerConfig
    from shadowprefill.serve.frontdoor import make_manager_app

    config = ManagerConfig.from_file(args.config)
    serve_forever(lambda: make_manager_app(config), args.host or config.host, args.port or config.port)
    return 0


def _replay(args) -> int:
    from shadowprefill.cluster.traces import load_sessions
    from shadowprefill.serve.replay import replay, switch_table

    model_map = None
    if args.model_map:
        model_map = dict(pair.split("=", 1) for pair in args.model_map.split(","))
    result = asyncio.run(replay(
        args.manager, load_sessions(args.sessions), api_key=args.api_key, model_map=model_map,
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


def register(subparsers) -> None:
    """Add serve-engine, serve-manager and replay to a `shadowprefill` sub-command parser."""
    p = subparsers.add_parser("serve-engine", help="serve the built-in engine over OpenAI-compatible HTTP")
    p.add_argument("--model", default="tiny", help="tiny | tiny_large | a local HF checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--shadow-mode", default="harvest-slo", choices=["none", "harvest", "harvest-slo", "eager"])
    p.add_argument("--n-min", type=int, default=16, help="smallest shadow chunk in tokens (paper: 256)")
    p.add_argument("--seed", type=int, default=0, help="random-weight seed of the tiny models")
    p.add_argument("--shadow-priority", type=int, default=1000,
                   help="requests with priority >= this are shadow work")
    p.add_argument("--shadow-class", default="engine", choices=["engine", "normal"],
                   help="engine: shadow requests become engine shadow jobs; normal: normal-priority requests")
    p.set_defaults(func=_serve_engine)

    p = subparsers.add_parser("serve-manager", help="run the shadow manager's OpenAI-compatible front door")
    p.add_argument("--config", required=True, help="JSON config (see shadowprefill.serve.config)")
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    p.set_defaults(func=_serve_manager)

    p = subparsers.add_parser("replay", help="replay sessions through a manager, with and without shadow")
    p.add_argument("--manager", required=True, help="manager base URL")
    p.add_argument("--sessions", required=True, help="JSONL session file (shadowprefill.cluster.traces)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model-map", default=None, help="recorded=served,... (default: by order of appearance)")
    p.add_argument("--vocab-size", type=int, default=512, help="recorded ids are mapped into [10, vocab)")
    p.add_argument("--max-output-tokens", type=int, default=16)
    p.add_argument("--max-prompt-tokens", type=int, default=2048, help="a session stops at a longer prompt")
    p.add_argument("--concurrency", type=int, default=2, help="sessions in flight")
    p.add_argument("--background-workers", type=int, default=1, help="clients sending normal traffic")
    p.add_argument("--background-prompt-tokens", type=int, default=128)
    p.add_argument("--min-gap-s", type=float, default=0.5)
    p.add_argument("--max-gap-s", type=float, default=2.0)
    p.add_argument("--out", default=None, help="write the full result JSON here")
    p.set_defaults(func=_replay)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shadowprefill")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
