"""`shadowprefill engine-demo`: shadow prefill on two real (tiny) models, wall clock, CPU or GPU.

A few agent sessions whose calls a Markov router switches between a small and a large model, with
background normal traffic on both engines, run twice on the same seed: once without shadow prefill and
once with Harvest-SLO (paper §3.2). Each model has one engine (`LLMEngine` with the real forward), stepped by
its own `EngineDriver` thread so the two instances run side by side as on two GPUs; the orchestration core
(`cluster.manager.ClusterManager`) places the calls and creates the shadow jobs (paper §3.1). It prints
switch-call TTFT, the prefix hit rate of switch calls and of all calls, and shadow tokens used vs wasted.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np
import torch

from shadowprefill.cluster.call_stats import call_metrics
from shadowprefill.cluster.manager import ClusterManager, Instance
from shadowprefill.cluster.router import MarkovRouter
from shadowprefill.cluster.workloads import Call, Session
from shadowprefill.engine import EngineConfig, LLMEngine, WallClock
from shadowprefill.model import Llama, ModelConfig
from shadowprefill.usage import nonneg_int, positive_int

MODELS = {"small": ModelConfig.tiny, "large": ModelConfig.tiny_large}


@dataclass
class DemoConfig:
    sessions: int = 8
    calls: int = 6
    first_input: int = 768        # tokens of the first call's prompt
    tool_output: int = 96         # new input per later call (tool result)
    output_tokens: int = 16
    gap_s: float = 0.3            # tool time between calls
    arrival_gap_s: float = 0.4    # between session starts
    switch_p: float = 0.4
    normal_rate: float = 4.0      # normal requests / s per engine
    normal_prompt: int = 256
    normal_output: int = 8
    seed: int = 0


def make_sessions(cfg: DemoConfig, vocab: int) -> list[Session]:
    """Append-only agent sessions with token ids inside the tiny vocabulary, routed by a Markov router."""
    rng = np.random.default_rng(cfg.seed)
    router = MarkovRouter(list(MODELS), p=cfg.switch_p, seed=cfg.seed)
    sessions = []
    for s in range(cfg.sessions):
        calls = []
        for k in range(cfg.calls):
            n = cfg.first_input if k == 0 else cfg.tool_output
            ids = tuple(int(x) for x in rng.integers(3, vocab, size=n))
            calls.append(Call("small", n, cfg.output_tokens, gap_s=0.0 if k == 0 else cfg.gap_s, input_ids=ids))
        draft = Session(f"s{s}", "tenant-0", "demo", s * cfg.arrival_gap_s, calls)
        route: list[str] = []
        for k in range(len(calls)):
            route.append(router.route(draft, k, route))
        routed = [Call(m, c.new_input_tokens, c.output_tokens, c.gap_s, input_ids=c.input_ids)
                  for m, c in zip(route, calls)]
        sessions.append(Session(draft.session_id, draft.tenant, draft.task, draft.arrival_s, routed))
    return sessions


class Locks:
    """The core's lock plus every engine driver's lock (each held by its thread while the engine steps).
    Whoever touches the core takes all of them, always in the same order, so the two engines' forwards
    overlap but nothing races."""

    def __init__(self, drivers):
        self.core = threading.Lock()
        self.drivers = list(drivers)
        self._stack = None

    def __enter__(self):
        stack = ExitStack()
        stack.enter_context(self.core)
        for d in self.drivers:
            stack.enter_context(d.lock)
        self._stack = stack

    def __exit__(self, *exc):
        self._stack.close()


def run_policy(shadow_mode: str, cfg: DemoConfig, device: str = "cpu") -> dict:
    """One run of the demo workload with `shadow_mode` ("none" or "harvest-slo"); returns its summary."""
    clock = WallClock()
    instances = {}
    for i, (name, make) in enumerate(MODELS.items()):
        model = Llama(make(), seed=i + 1, device=device)
        # SLOs and n_min scaled to tiny models on a CPU (the paper's 25 ms TPOT floor and 256-token n_min
        # are sized for 7B+ models on H100s): a 0.1 s TPOT SLO gives idle iterations a 50 ms cap (β·T).
        engine = LLMEngine(model, EngineConfig(num_blocks=1024, block_size=16, token_budget=1024,
                                               shadow_mode=shadow_mode, model_id=name, tpot_slo_s=0.1,
                                               ttft_slo_s=2.0, n_min=64), clock=clock)
        instances[name] = [Instance(f"{name}/0", name, 0, engine)]
    drivers = [group[0].driver for group in instances.values()]
    locks = Locks(drivers)
    manager = ClusterManager(instances, shadows=shadow_mode != "none", on_work=lambda inst: inst.driver.wake())
    vocab = min(make().vocab_size for make in MODELS.values())
    sessions = make_sessions(cfg, vocab)
    finished: list = []
    outputs: dict[str, list[list[int]]] = {s.session_id: [] for s in sessions}
    for group in instances.values():
        inst = group[0]

        def on_outputs(outs, inst=inst):
            with locks:
                finished.extend(manager.on_outputs(inst, outs))

        inst.driver.on_outputs = on_outputs
    rng = np.random.default_rng(cfg.seed + 1)
    start = clock.now()
    next_call = {s.session_id: (start + s.arrival_s, 0) for s in sessions}
    by_id = {s.session_id: s for s in sessions}
    next_normal = {name: start + rng.exponential(1 / cfg.normal_rate) for name in MODELS}
    normal_id = 0
    records = []
    for d in drivers:
        d.start(name="engine-demo")
        d.post(lambda: torch.set_num_threads(1))
    try:
        while next_call and all(d.running for d in drivers):
            with locks:
                now = clock.now()
                for ticket in finished:                          # a call ended: schedule the session's next
                    out = ticket.output
                    outputs[ticket.session_id].append(list(out.token_ids))
                    records.append(ticket)
                    session = by_id[ticket.session_id]
                    k = ticket.call_index + 1
                    if k < len(session.calls):
                        next_call[session.session_id] = (now + session.calls[k].gap_s, k)
                    else:
                        del next_call[session.session_id]
                        manager.end_session(session.session_id, session.tenant)
                finished.clear()
                for sid, (due, k) in list(next_call.items()):
                    if due is not None and due <= now:
                        session = by_id[sid]
                        prompt = [int(x) for x in session.prompt_ids(k, outputs=outputs[sid])]
                        manager.submit_call(sid, k, session.calls[k].model, prompt, cfg.output_tokens,
                                            task=session.task, tenant=session.tenant)
                        next_call[sid] = (None, k)               # in flight
                for name, due in next_normal.items():
                    if due <= now:
                        prompt = [int(x) for x in rng.integers(3, vocab, size=cfg.normal_prompt)]
                        manager.submit_normal(instances[name][0], f"n{normal_id}", prompt, cfg.normal_output)
                        normal_id += 1
                        next_normal[name] = now + rng.exponential(1 / cfg.normal_rate)
            time.sleep(0.002)
    finally:
        for d in drivers:
            d.stop()
    for d in drivers:
        if d.error is not None:
            raise d.error
    return summarize(records, [g[0].engine for g in instances.values()], clock.now() - start)


def summarize(tickets, engines, wall_s: float) -> dict:
    """The simulator's call metrics (`cluster.call_stats.call_metrics`) of the finished calls, plus the
    engines' shadow token counts and the wall time."""
    block = engines[0].config.block_size
    return {
        **call_metrics(tickets),
        "shadow_tokens": sum(e.stats.shadow_tokens for e in engines),
        "shadow_tokens_used": sum(e.kv_stats.shadow_blocks_promoted for e in engines) * block,
        "shadow_tokens_wasted": sum(e.kv_stats.shadow_blocks_wasted for e in engines) * block,
        "wall_s": wall_s,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="shadowprefill engine-demo", description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=positive_int, default=DemoConfig.sessions,
                        help="agent sessions per run")
    parser.add_argument("--seed", type=nonneg_int, default=0, help="seed of the models' weights and the traffic")
    args = parser.parse_args(argv)
    return run_demo(args)


def run_demo(args) -> int:
    cfg = DemoConfig(sessions=args.sessions, seed=args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"shadow prefill demo: 2 tiny models ({', '.join(MODELS)}) on {device}, {cfg.sessions} sessions x "
          f"{cfg.calls} calls, switch p={cfg.switch_p}, normal traffic {cfg.normal_rate}/s per engine")
    # warm-up (first-call costs of torch and the kernels), then both policies on the same seed
    run_policy("harvest-slo", DemoConfig(sessions=2, calls=2, seed=cfg.seed + 100), device)
    results = {mode: run_policy(mode, cfg, device) for mode in ("none", "harvest-slo")}
    rows = [("calls (switch calls)", lambda r: f"{r['num_calls']} ({r['num_switch_calls']})"),
            ("switch-call TTFT, mean", lambda r: f"{r['switch_call_ttft_mean_s'] * 1e3:.1f} ms"),
            ("all-call TTFT, mean", lambda r: f"{r['llm_call_ttft_mean_s'] * 1e3:.1f} ms"),
            ("switch-call prefix hit rate", lambda r: f"{r['switch_hit_rate']:.1%}"),
            ("all-call prefix hit rate", lambda r: f"{r['hit_rate']:.1%}"),
            ("shadow tokens computed", lambda r: f"{r['shadow_tokens']}"),
            ("shadow tokens used / wasted", lambda r: f"{r['shadow_tokens_used']} / {r['shadow_tokens_wasted']}"),
            ("wall time", lambda r: f"{r['wall_s']:.1f} s")]
    print(f"{'':<30}{'no shadow':>16}{'harvest-slo':>16}")
    for label, fmt in rows:
        print(f"{label:<30}{fmt(results['none']):>16}{fmt(results['harvest-slo']):>16}")
    return 0


def register(subparsers) -> None:
    """Adds `shadowprefill engine-demo` to the command line."""
    parser = subparsers.add_parser("engine-demo", help="shadow prefill on two tiny real models: no shadow vs Harvest-SLO")
    parser.add_argument("--sessions", type=positive_int, default=DemoConfig.sessions,
                        help="agent sessions per run")
    parser.add_argument("--seed", type=nonneg_int, default=0, help="seed of the models' weights and the traffic")
    parser.set_defaults(func=run_demo)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
