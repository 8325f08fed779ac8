"""Gateway decision + registry lookup time with a populated registry, against the paper's budget (issue 22).

    .venv/bin/python bench/gateway_decision.py [--entries 10000] [--tokens 1000] [--calls 2000]

Builds a `CacheRegistry` with `--entries` live entries (8 tenants, 3 models, 6 sites, 32-token pages,
random 256..2048-token spans, as `gateway.engine_view` inserts them from KV events), then times, per call,
what the manager does for `"model": "auto"`: `ControlPlane.decide` over 3 models x 2 instances (the
registry hits for each model, reuse / reprefill, transfer etc. listed infeasible) for a `--tokens`-token
prompt that extends one registered span. Prints the median and p99 in ms next to Table III's routing +
lookup budget (t_route + t_lookup = 2 + 3 ms, paper 003 §VI). A measurement, never asserted.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from shadowprefill.gateway.analytic import DEFAULT_PARAMS
from shadowprefill.gateway.control_plane import Candidate, Constraints, ControlPlane, GatewayRequest
from shadowprefill.gateway.prefill_fit import FittedPrefillModel
from shadowprefill.gateway.registry import CacheLayout, CacheRegistry, Location
from shadowprefill.serve.gateway_live import NO_PATH

MODELS, SITES, TENANTS = ("small", "medium", "large"), [f"http://10.0.0.{i}:8000" for i in range(6)], 8


def build(entries: int, rng: random.Random):
    reg, spans = CacheRegistry(), []
    layout = CacheLayout(32, 1, 1, 1)
    while len(reg) < entries:
        tenant, model = f"t{rng.randrange(TENANTS)}", rng.choice(MODELS)
        tokens = [rng.randrange(10, 50_000) for _ in range(rng.randrange(256, 2049))]
        reg.insert(tenant, model, "live", tokens, layout, Location(rng.choice(SITES)), provenance="engine")
        spans.append((tenant, tokens))
    return reg, spans


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=10_000)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.entries < 1 or args.tokens < 1 or args.calls < 1:
        ap.error("--entries, --tokens and --calls must be >= 1")
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    reg, spans = build(args.entries, rng)
    built = time.perf_counter() - t0
    plane = ControlPlane(registry=reg, estimator=FittedPrefillModel(), overhead_s=0.0)
    cands = [Candidate(m, s, 0.6 + 0.1 * i, 0.1 * (i + 1), 0.1, queue_s=0.01, output_price=0.4 * (i + 1))
             for i, m in enumerate(MODELS) for s in SITES[:2]]
    cons = Constraints(min_quality=0.0)
    times, chosen = [], {}
    for _ in range(args.calls):
        tenant, span = rng.choice(spans)
        prompt = (span + [rng.randrange(10, 50_000) for _ in range(args.tokens)])[:args.tokens]
        t = time.perf_counter()
        d = plane.decide(GatewayRequest(tenant, prompt, output_tokens=16), cands, cons, infeasible=NO_PATH)
        times.append(time.perf_counter() - t)
        chosen[d.chosen.action] = chosen.get(d.chosen.action, 0) + 1
    times.sort()
    med, p99 = statistics.median(times) * 1e3, times[int(0.99 * (len(times) - 1))] * 1e3
    budget = DEFAULT_PARAMS.t_route_ms + DEFAULT_PARAMS.t_lookup_ms
    print(f"registry: {len(reg)} entries built in {built:.1f} s; {args.calls} decisions of {args.tokens}-token "
          f"prompts over {len(cands)} (model, instance) candidates")
    print(f"decision + registry lookup: median {med:.3f} ms, p99 {p99:.3f} ms; Table III routing + lookup "
          f"budget {budget:.1f} ms (t_route {DEFAULT_PARAMS.t_route_ms} + t_lookup {DEFAULT_PARAMS.t_lookup_ms})")
    print(f"actions chosen: {chosen}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
