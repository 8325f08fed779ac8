"""Client-side scenarios for the vLLM shadow scheduler (stock vLLM and `ShadowScheduler` run the same ones).

    python tests/vllm_harness/shadow_scenario.py itl   --url URL --model NAME --out FILE [--shadows 3]
    python tests/vllm_harness/shadow_scenario.py evict --url URL --model NAME --out FILE
    (also: yield, promote, switch; cap_scenario is run by the suite, against the plugin only)

`itl`: a steady stream of streaming normal requests (priority 1, so decodes always run) for a baseline
window without shadows, then the same stream with a burst of long shadow requests (priority 1000,
`max_tokens` 1); after each shadow finishes, its switch call (the shadow's prompt + 32 new tokens, priority
0 = routed, streaming with usage) records TTFT and `cached_tokens`. Inter-token latencies are taken over the
window in which shadows are pending and over a baseline window, twice: from vLLM's engine-side histogram
(`vllm:inter_token_latency_seconds`, quantiles interpolated within buckets; every decoding request in the
window, i.e. the stream plus a few switch and comparison calls) and from the client's token arrival times
(what a user sees, including API-server lag).
Finally a fixed list of normal prompts is run one at a time (greedy) while shadows are pending, for an
output comparison between servers.

`evict`: on a server with a small KV pool: a normal prompt A, then a shadow S of the same length, then a
normal filler that needs `k` more blocks than are free without evicting cached ones; then A and S again
(normal, `max_tokens` 1) report how much of each is still cached. Block counts come from the server's
`/metrics` (`vllm:cache_config_info`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from pathlib import Path

import httpx

SHADOW_PRIORITY, NORMAL_PRIORITY, ROUTED_PRIORITY = 1000, 1, 0
TIMEOUT_S = 180.0            # any one request (a stuck shadow fails the scenario instead of hanging CI)
VOCAB = (10, 500)            # token ids inside the harness models' vocabulary


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


def percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for an empty list."""
    if not xs:
        return None
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(round(q / 100.0 * len(s) + 0.5)) - 1))
    return s[k]


async def stream_completion(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int,
                            priority: int, on_token: asyncio.Event | None = None) -> dict:
    """One streaming completion: token arrival times, text, usage (with cached tokens). `on_token` is set
    once a token arrived."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
            "ignore_eos": True, "priority": priority, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    t0, times, text, usage = time.perf_counter(), [], [], None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if d.get("usage"):
                usage = d["usage"]
            for c in d.get("choices") or ():
                n = len(c["token_ids"]) if c.get("token_ids") is not None else int(bool(c.get("text")))
                if n:                   # one time per token (a token may decode to no text of its own)
                    times.extend([time.perf_counter()] * n)
                    text.append(c.get("text") or "")
                    if on_token is not None:
                        on_token.set()
    return {"t0": t0, "times": times, "text": "".join(text), "usage": usage}


async def completion(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int,
                     priority: int, **extra) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "priority": priority, "return_token_ids": True, **extra}
    t0 = time.perf_counter()
    r = await client.post("/v1/completions", json=body)
    r.raise_for_status()
    d = r.json()
    choice = d["choices"][0]
    return {"t0": t0, "t1": time.perf_counter(), "text": choice["text"], "token_ids": choice.get("token_ids"),
            "finish_reason": choice.get("finish_reason"), "usage": d["usage"]}


def cached_of(usage: dict | None) -> int:
    details = (usage or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


async def _stream_loop(client, model, rng, stop: asyncio.Event, records: list, prompt_len: int,
                       max_tokens: int) -> None:
    while not stop.is_set():
        records.append(await stream_completion(client, model, ids(rng, prompt_len), max_tokens, NORMAL_PRIORITY))


ITL_BUCKET = re.compile(r'^vllm:inter_token_latency_seconds_bucket\{[^}]*le="([^"]+)"[^}]*\} (\S+)$', re.M)


async def itl_histogram(client: httpx.AsyncClient) -> dict[float, float]:
    """vLLM's engine-side inter-token latency histogram (cumulative counts by upper bound). vLLM computes
    each gap from the EngineCore's output timestamps, so API-server lag (tokens reaching the client in
    bursts on a busy CPU) does not enter it."""
    text = (await client.get("/metrics")).text
    return {float(le): float(n) for le, n in ITL_BUCKET.findall(text)}


def hist_quantile(before: dict, after: dict, q: float) -> float | None:
    """Quantile q (0-1) of the gaps recorded between two snapshots, interpolated linearly within a bucket
    (Prometheus' histogram_quantile); None if no gap was recorded."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1]
    if total <= 0:
        return None
    rank, lo, prev = q * total, 0.0, 0.0
    for b, c in zip(bounds, counts):
        if c >= rank:
            if b == float("inf"):
                return lo
            return lo + (b - lo) * ((rank - prev) / (c - prev) if c > prev else 1.0)
        lo, prev = b, c
    return lo


def hist_summary(before: dict, after: dict) -> dict:
    n = (after.get(float("inf"), 0.0) - before.get(float("inf"), 0.0))
    return {"n": int(n), "p50": hist_quantile(before, after, 0.5), "p99": hist_quantile(before, after, 0.99)}


def gaps_in(records: list[dict], start: float, end: float) -> list[float]:
    """Inter-token gaps of streamed requests whose later token arrived in [start, end]."""
    out = []
    for rec in records:
        ts = rec["times"]
        out.extend(b - a for a, b in zip(ts, ts[1:]) if start <= b <= end)
    return out


async def itl_scenario(url: str, model: str, *, shadows: int = 3, shadow_len: int = 3000, streams: int = 4,
                       prompt_len: int = 64, max_tokens: int = 48, baseline_s: float = 6.0, seed: int = 0,
                       block_size: int = 32, compare_prompts: int = 4, max_stream_s: float = 30.0) -> dict:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as client:
        await completion(client, model, ids(rng, 16), 2, NORMAL_PRIORITY)             # warm the path
        stop, records = asyncio.Event(), []
        loops = [asyncio.create_task(_stream_loop(client, model, random.Random(seed * 100 + i), stop, records,
                                                  prompt_len, max_tokens)) for i in range(streams)]
        await asyncio.sleep(1.0)
        b0, h_b0 = time.perf_counter(), await itl_histogram(client)
        await asyncio.sleep(baseline_s)
        b1, h_b1 = time.perf_counter(), await itl_histogram(client)
        shadow_prompts = [ids(rng, shadow_len) for _ in range(shadows)]
        switches: list[dict] = []

        async def shadow_then_switch(prompt: list[int]) -> dict:
            done = await completion(client, model, prompt, 1, SHADOW_PRIORITY)
            sw = await stream_completion(client, model, prompt + ids(rng, 32), 4, ROUTED_PRIORITY)
            switches.append({"shadow_s": done["t1"] - done["t0"], "shadow_done": done["t1"],
                             "shadow_len": len(prompt), "prompt_tokens": sw["usage"]["prompt_tokens"],
                             "cached_tokens": cached_of(sw["usage"]),
                             "ttft_s": sw["times"][0] - sw["t0"] if sw["times"] else None})
            return done

        s0, h_s0 = time.perf_counter(), await itl_histogram(client)
        tasks = [asyncio.create_task(shadow_then_switch(p)) for p in shadow_prompts]
        # greedy outputs of fixed prompts, one at a time, while shadows are pending
        cmp_rng = random.Random(seed + 7)
        compare = []
        for _ in range(compare_prompts):
            compare.append((await completion(client, model, ids(cmp_rng, 96), 8, NORMAL_PRIORITY))["token_ids"])
        # the normal stream runs while shadows are pending, for at most max_stream_s (then the instance
        # idles and the shadows finish in idle steps)
        finished, _ = await asyncio.wait(tasks, timeout=max(0.0, s0 + max_stream_s - time.perf_counter()))
        s1 = time.perf_counter() if len(finished) < len(tasks) else max(t.result()["t1"] for t in tasks)
        h_s1 = await itl_histogram(client)
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*loops)
        done = await asyncio.gather(*tasks)
    base, during = gaps_in(records, b0, b1), gaps_in(records, s0, s1)
    return {
        "model": model, "shadows": shadows, "shadow_len": shadow_len, "streams": streams,
        "baseline_window_s": b1 - b0, "shadow_window_s": s1 - s0,
        "itl_baseline": hist_summary(h_b0, h_b1), "itl_shadow": hist_summary(h_s0, h_s1),
        "client_itl_baseline": {"n": len(base), "p50": percentile(base, 50), "p99": percentile(base, 99),
                                "max": max(base, default=None)},
        "client_itl_shadow": {"n": len(during), "p50": percentile(during, 50), "p99": percentile(during, 99),
                              "max": max(during, default=None)},
        "shadows_done_while_streaming": len(finished), "shadows_end_s": max(d["t1"] for d in done) - s0,
        "switches": switches, "compare_outputs": compare, "block_size": block_size,
        "window": {"baseline": [b0, b1], "shadow": [s0, s1]},
        "clock_offset": time.time() - time.perf_counter(),
    }


async def num_gpu_blocks(client: httpx.AsyncClient) -> int:
    text = (await client.get("/metrics")).text
    m = re.search(r'vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', text)
    if not m:
        raise RuntimeError("vllm:cache_config_info with num_gpu_blocks not found in /metrics")
    return int(m.group(1))


async def evict_scenario(url: str, model: str, *, blocks_a: int = 16, evict: int = 8, block_size: int = 32,
                         seed: int = 1) -> dict:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as client:
        total = await num_gpu_blocks(client)
        usable = total - 1                              # vLLM's block 0 is its null block
        a, s = ids(rng, blocks_a * block_size + 1), ids(rng, blocks_a * block_size + 1)
        await completion(client, model, a, 1, NORMAL_PRIORITY)
        await completion(client, model, s, 1, SHADOW_PRIORITY)
        free_uncached = usable - 2 * blocks_a           # a fresh server caches nothing else
        filler_blocks = free_uncached + evict
        await completion(client, model, ids(rng, filler_blocks * block_size - 1), 1, NORMAL_PRIORITY)
        again_a = await completion(client, model, a, 1, NORMAL_PRIORITY)
        again_s = await completion(client, model, s, 1, NORMAL_PRIORITY)
    return {"model": model, "num_gpu_blocks": total, "blocks_a": blocks_a, "evict": evict,
            "filler_blocks": filler_blocks, "block_size": block_size,
            "normal_cached_after": cached_of(again_a["usage"]), "shadow_cached_after": cached_of(again_s["usage"])}


async def yield_scenario(url: str, model: str, *, shadow_blocks: int = 17, shadow_decode: int = 600,
                         block_size: int = 32, seed: int = 2, decoding=None) -> dict:
    """A running shadow (it decodes `shadow_decode` tokens after its prompt, holding its blocks) and then a
    normal request whose prompt needs more blocks than are free without the shadow's: which finishes first?
    vLLM admits waiting requests only into free memory (no preemption for them), so on stock vLLM the normal
    request waits for the shadow; ShadowScheduler preempts the shadow for it. The normal request is sent once
    the shadow decodes: by default when its first token reached the client (the API server may deliver a
    fast stream late and merged), or when the async predicate `decoding()` says so (the suite reads the
    scheduler's stats file, which the EngineCore writes as it steps)."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as client:
        total = await num_gpu_blocks(client)
        need = (await client.get("/v1/models")).json()["data"][0]["max_model_len"] // block_size
        if need <= total - 1 - shadow_blocks - 1:
            raise ValueError(f"pool of {total} blocks too large: a {need}-block prompt fits beside the shadow")
        first = asyncio.Event()
        shadow = asyncio.create_task(stream_completion(client, model, ids(rng, shadow_blocks * block_size),
                                                       shadow_decode, SHADOW_PRIORITY, on_token=first))
        if decoding is None:
            await asyncio.wait_for(first.wait(), 120)  # the shadow decodes: it holds its blocks
        else:
            for _ in range(12000):
                if await decoding():
                    break
                await asyncio.sleep(0.01)
            else:
                raise RuntimeError("the shadow request did not start decoding within 120 s")
        sent = time.perf_counter()
        normal = await completion(client, model, ids(rng, need * block_size - 1), 1, NORMAL_PRIORITY)
        done = await shadow
    return {"model": model, "num_gpu_blocks": total, "normal_blocks": need, "shadow_blocks": shadow_blocks,
            "normal_done_first": normal["t1"] < done["times"][-1], "normal_s": normal["t1"] - normal["t0"],
            "normal_sent_after_shadow_s": sent - done["t0"], "shadow_s": done["times"][-1] - done["t0"],
            "shadow_output_tokens": len(done["times"])}


async def cap_scenario(url: str, model: str, *, cap_blocks: int, shadows: int = 6, blocks_each: int = 41,
                       block_size: int = 32, seed: int = 3, settle_s: float = 1.5) -> dict:
    """Shadows totalling ~1.5x the shadow-KV cap (`shadows` x `blocks_each`), one after another (each waits for cold shadow entries to
    recycle at the cap); then vLLM's prefix cache is asked how much of each is still cached (a normal request
    of the shadow's prompt, `max_tokens` 1, on a pool far larger than the probes need, so probing evicts
    nothing). The sum is what vLLM's block pool holds of the shadows, against the cap."""
    rng = random.Random(seed)
    prompts = [ids(rng, blocks_each * block_size) for _ in range(shadows)]
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as client:
        total = await num_gpu_blocks(client)
        for p in prompts:
            await completion(client, model, p, 1, SHADOW_PRIORITY)
            await asyncio.sleep(settle_s)              # older shadow entries turn cold (cold_age_s) meanwhile
        cached = [cached_of((await completion(client, model, p, 1, NORMAL_PRIORITY))["usage"]) for p in prompts]
    return {"model": model, "num_gpu_blocks": total, "cap_blocks": cap_blocks, "shadows": shadows,
            "blocks_each": blocks_each, "block_size": block_size, "cached_tokens": cached,
            "cached_blocks": sum(c // block_size for c in cached), "sent_blocks": shadows * blocks_each}


async def promote_scenario(url: str, model: str, *, blocks: int = 16, evict: int = 8, block_size: int = 32,
                           seed: int = 4) -> dict:
    """Shadow S1, then a normal request A = S1's prompt (a prefix hit: S1's blocks are promoted), then shadow
    S2, then a filler needing `evict` more blocks than are free: the evict-first class gives up S2's blocks
    and A keeps S1's. On stock vLLM (LRU) S1/A's blocks, freed before S2's, go first."""
    rng = random.Random(seed)
    s1, s2 = ids(rng, blocks * block_size + 1), ids(rng, blocks * block_size + 1)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as client:
        (await client.post("/reset_prefix_cache")).raise_for_status()     # VLLM_SERVER_DEV_MODE=1: start empty
        total = await num_gpu_blocks(client)
        await completion(client, model, s1, 1, SHADOW_PRIORITY)
        hit = cached_of((await completion(client, model, s1, 1, NORMAL_PRIORITY))["usage"])
        await completion(client, model, s2, 1, SHADOW_PRIORITY)
        filler_blocks = (total - 1 - 2 * blocks) + evict
        await completion(client, model, ids(rng, filler_blocks * block_size - 1), 1, NORMAL_PRIORITY)
        again_a = cached_of((await completion(client, model, s1, 1, NORMAL_PRIORITY))["usage"])
        again_s2 = cached_of((await completion(client, model, s2, 1, NORMAL_PRIORITY))["usage"])
    return {"model": model, "num_gpu_blocks": total, "blocks": blocks, "evict": evict, "block_size": block_size,
            "first_hit": hit, "promoted_cached_after": again_a, "shadow_cached_after": again_s2}


async def switch_scenario(url: str, model: str, *, blocks: int = 20, block_size: int = 32, seed: int = 5,
                          new_tokens: int = 40, max_tokens: int = 12) -> dict:
    """A shadow of `blocks` blocks, then its switch call (the shadow's prompt + `new_tokens`, routed, greedy,
    with logprobs) served from the shadow's KV, and a cold run of the same prompt under another cache_salt
    (no prefix hits). The server runs float32, so the two outputs must be the same tokens."""
    rng = random.Random(seed)
    shadow = ids(rng, blocks * block_size)
    prompt = shadow + ids(rng, new_tokens)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as client:
        t0 = time.time()
        await completion(client, model, shadow, 1, SHADOW_PRIORITY)
        warm = await completion(client, model, prompt, max_tokens, ROUTED_PRIORITY, logprobs=1)
        cold = await completion(client, model, prompt, max_tokens, ROUTED_PRIORITY, logprobs=1,
                                cache_salt="cold-run")
    return {"model": model, "blocks": blocks, "block_size": block_size, "shadow_sent_at": t0,
            "shadow_len": len(shadow), "prompt_tokens": warm["usage"]["prompt_tokens"],
            "warm_cached_tokens": cached_of(warm["usage"]), "cold_cached_tokens": cached_of(cold["usage"]),
            "warm_tokens": warm["token_ids"], "cold_tokens": cold["token_ids"]}


async def streamed_scenario(small_url: str, large_url: str, *, stream: bool, sessions: int = 1, first: int = 0,
                            prompt_len: int = 96, out_len: int = 176, new_tokens: int = 40, think_s: float = 0.1,
                            block_size: int = 32, seed: int = 11) -> dict:
    """Issue 21 item 3, through the manager (`shadowprefill.serve`) in front of `small` and `large`: per
    session, a streaming call on `small` (`out_len` tokens), then, `think_s` after it ends (an agent's tool
    step), its switch call on `large` (prompt + output + `new_tokens`). `stream`: the manager's streamed
    shadows (the shadow on `large` grows as the answer streams) or one whole request after the call. Each
    session's shadows carry `X-Request-Id` shadow-<tenant>.<session>-..., so the server's per-step stats
    attribute shadow tokens to sessions. `first`: the first session's number (ids stay unique per server)."""
    from shadowprefill.serve.app_runner import AppThread
    from shadowprefill.serve.config import ManagerConfig
    from shadowprefill.serve.frontdoor import MANAGER_KEY, make_manager_app

    config = ManagerConfig.from_dict({
        "models": {"small": [{"url": small_url, "served_model_name": "small"}],
                   "large": [{"url": large_url, "served_model_name": "large"}]},
        "api_keys": {"key-s": "tenant-s"}, "tenant_cache_salt": True, "read_timeout_s": TIMEOUT_S,
        "shadow": {"stream": stream, "stream_tokens": block_size, "poll_s": 0.02, "timeout_s": TIMEOUT_S}})
    thread = AppThread(lambda: make_manager_app(config)).start()
    rng = random.Random(seed + (1 if stream else 0))
    tag = "streamed" if stream else "whole"
    out = []
    try:
        async with httpx.AsyncClient(base_url=thread.url, timeout=TIMEOUT_S,
                                     headers={"Authorization": "Bearer key-s"}) as client:
            for i in range(first, first + sessions):
                sid = f"{tag}{i}"
                head = {"X-Session-Id": sid}
                prompt = ids(rng, prompt_len)
                body = {"model": "small", "prompt": prompt, "max_tokens": out_len, "stream": True,
                        "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
                t0 = time.time()
                out_ids: list[int] = []
                async with client.stream("POST", "/v1/completions", json=body, headers=head) as r:
                    r.raise_for_status()
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            for c in json.loads(line[6:]).get("choices") or ():
                                out_ids.extend(c.get("token_ids") or ())
                t1 = time.time()
                await asyncio.sleep(think_s)
                context = prompt + out_ids
                r = await client.post("/v1/completions", headers=head, json={
                    "model": "large", "prompt": context + ids(rng, new_tokens), "max_tokens": 1,
                    "temperature": 0.0, "ignore_eos": True})
                r.raise_for_status()
                usage = r.json()["usage"]
                t2 = time.time()
                idle = (await client.post("/manager/wait-shadows?timeout=120", timeout=TIMEOUT_S)).json()["idle"]
                out.append({"session": sid, "shadow_id": f"shadow-tenant-s.{sid}-", "context": len(context),
                            "output_tokens": len(out_ids), "cached_tokens": cached_of(usage),
                            "prompt_tokens": usage["prompt_tokens"], "call_start": t0, "call_end": t1,
                            "switch_at": t2, "shadows_idle": idle})
        stats = thread.app[MANAGER_KEY].summary()["instances"][large_url]
    finally:
        thread.stop()
    whole = [s["context"] // block_size * block_size for s in out]
    return {"stream": stream, "block_size": block_size, "think_s": think_s, "sessions": out,
            "covered": sum(s["cached_tokens"] >= w for s, w in zip(out, whole)),
            "manager_stats": {k: v for k, v in stats.items() if k.startswith("shadow")}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=("itl", "evict", "yield", "promote", "switch"))
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shadows", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="itl: prompts (each run on one server needs its own)")
    ap.add_argument("--shadow-len", type=int, default=3000, help="itl: tokens of each shadow")
    ap.add_argument("--streams", type=int, default=4, help="itl: streaming normal clients")
    args = ap.parse_args()
    if args.scenario == "itl":
        result = asyncio.run(itl_scenario(args.url, args.model, shadows=args.shadows, seed=args.seed,
                                          shadow_len=args.shadow_len, streams=args.streams))
    elif args.scenario == "evict":
        result = asyncio.run(evict_scenario(args.url, args.model))
    elif args.scenario == "promote":
        result = asyncio.run(promote_scenario(args.url, args.model))
    elif args.scenario == "switch":
        result = asyncio.run(switch_scenario(args.url, args.model))
    else:
        result = asyncio.run(yield_scenario(args.url, args.model))
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("compare_outputs", "window")}))


if __name__ == "__main__":
    main()
