"""Switch-call cached-token fraction and TTFT with and without shadow, through the manager.

    python tests/vllm_harness/measure.py [--out FILE]       # peers from $SP_SERVE_PEERS, else built-in

Starts a manager over the peers (built-in: two engine servers started here), writes a session file of
switching sessions, and runs `shadowprefill replay` (the CLI's code path: serve.replay.replay) with one
background worker. Prints the table the README shows.
"""
import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from shadowprefill.cluster.traces import load_sessions, save_sessions  # noqa: E402
from shadowprefill.cluster.workloads import Call, Session  # noqa: E402
from shadowprefill.serve.app_runner import AppThread  # noqa: E402
from shadowprefill.serve.config import ManagerConfig  # noqa: E402
from shadowprefill.serve.frontdoor import make_manager_app  # noqa: E402
from shadowprefill.serve.replay import replay, switch_table  # noqa: E402

ROUTES = [["small", "large", "large", "small"], ["large", "small", "small", "large"],
          ["small", "small", "large", "small"], ["large", "large", "small", "large"]]


def sessions(n: int = 8) -> list[Session]:
    out = []
    for i in range(n):
        route = ROUTES[i % len(ROUTES)]
        calls = [Call(model=m, new_input_tokens=1000 if k == 0 else 100, output_tokens=8, gap_s=1.0)
                 for k, m in enumerate(route)]
        out.append(Session(f"measure-{i}", "default", "measure", 0.0, calls))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    threads = []
    spec = os.environ.get("SP_SERVE_PEERS")
    if spec:
        peers = json.loads(Path(spec).read_text())
        kind = peers.get("kind", "vllm")
        models = {n: [{"url": m["url"], "served_model_name": m["served_model_name"]}]
                  for n, m in peers["models"].items()}
    else:
        from shadowprefill.serve.engine_server import make_engine_server
        kind = "builtin"
        threads = [AppThread(make_engine_server(m, model_name=m).app).start() for m in ("tiny", "tiny_large")]
        models = {"small": [{"url": threads[0].url, "served_model_name": "tiny"}],
                  "large": [{"url": threads[1].url, "served_model_name": "tiny_large"}]}
    config = ManagerConfig.from_dict({"models": models, "shadow": {"poll_s": 0.02}})
    manager = AppThread(lambda: make_manager_app(config)).start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "sessions.jsonl"
            save_sessions(path, sessions())
            result = asyncio.run(replay(manager.url, load_sessions(path), model_map={"small": "small", "large": "large"},
                                        concurrency=2, workers=1, min_gap_s=1.0, max_gap_s=1.0))
    finally:
        manager.stop()
        for t in threads:
            t.stop()
    print(f"peer: {kind}")
    print(switch_table(result["summary"]))
    print(f"background requests: {result['background_requests']}")
    if args.out:
        Path(args.out).write_text(json.dumps({"peer": kind, **result}, indent=2))


if __name__ == "__main__":
    main()
