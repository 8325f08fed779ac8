"""Replay a session file through a running manager, with and without shadow, under background load.

Each session runs twice, once per policy ("no-shadow": `X-Shadow: off`; "harvest": shadows on), under
distinct session ids and token seeds so the passes never share prefix-cache entries. Call k's prompt is
the kept prefix of the history (earlier prompt + the tokens the model actually generated, read back with
`return_token_ids`) followed by call k's recorded new input, mapped into the served vocabulary; its model
is the recorded one, renamed onto the manager's models (`model_map`, default: the file's models in order
of appearance onto the manager's `/v1/models`). Calls stream, so TTFT is measured at the client. Between
calls a session waits its recorded tool time, clamped to [min_gap_s, max_gap_s]. Background load: `workers`
clients send stateless normal-priority requests (priority 1, no session) in a loop during each pass.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time

import httpx

from shadowprefill.cluster.workloads import Session
from shadowprefill.serve.metrics import ServeCall, summarize_by_policy

POLICIES = ("no-shadow", "harvest")


def _map_ids(ids, vocab_size: int) -> list[int]:
    span = vocab_size - 10
    return [int(t) % span + 10 for t in ids]


async def _stream_call(client: httpx.AsyncClient, body: dict, headers: dict) -> dict:
    """Stream one completion; returns ids, usage, ttft, latency (None values on failure, with error)."""
    start = time.monotonic()
    first, ids, usage, error = None, [], None, None
    try:
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    obj = json.loads(line[5:])
                    if "error" in obj:
                        error = obj["error"].get("message")
                        continue
                    for ch in obj.get("choices") or []:
                        got = ch.get("token_ids") or []
                        if (got or ch.get("text")) and first is None:
                            first = time.monotonic()
                        ids.extend(got)
                    if obj.get("usage"):
                        usage = obj["usage"]
    except httpx.HTTPError as exc:
        error = repr(exc)
    return {"ids": ids, "usage": usage or {}, "first": first, "start": start, "finish": time.monotonic(),
            "error": error}


async def _run_session(client, session: Session, policy: str, model_map: dict, vocab: int, max_output: int,
                       max_prompt: int, gaps: tuple[float, float], records: list) -> None:
    history: list[int] = []
    prev_model = None
    for k, call in enumerate(session.calls):
        kept = len(history) if call.prefix_tokens is None else min(call.prefix_tokens, len(history))
        prompt = history[:kept] + _map_ids(session.new_input_ids(k), vocab)
        if len(prompt) > max_prompt:
            break
        if k:
            await asyncio.sleep(min(max(call.gap_s, gaps[0]), gaps[1]))
        model = model_map[call.model]
        body = {"model": model, "prompt": prompt, "max_tokens": max(1, min(call.output_tokens, max_output)),
                "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
                "ignore_eos": True}
        headers = {"X-Session-Id": session.session_id}
        if policy == "no-shadow":
            headers["X-Shadow"] = "off"
        res = await _stream_call(client, body, headers)
        usage = res["usage"]
        records.append(ServeCall(
            session_id=session.session_id, call_index=k, tenant="", model=model, instance="",
            is_switch=prev_model is not None and prev_model != model, policy=policy, arrival=res["start"],
            first_token=res["first"], finish=res["finish"], prompt_tokens=usage.get("prompt_tokens"),
            cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            output_tokens=usage.get("completion_tokens"), stream=True, status=200 if not res["error"] else 599,
            error=res["error"]))
        if res["error"]:
            return
        history = prompt + res["ids"]
        prev_model = model


async def _background(client, models: list[str], vocab: int, prompt_tokens: int, stop: asyncio.Event,
                      seed: int) -> int:
    rng, sent = random.Random(seed), 0
    while not stop.is_set():
        body = {"model": rng.choice(models), "prompt": [rng.randrange(10, vocab) for _ in range(prompt_tokens)],
                "max_tokens": 8, "priority": 1, "ignore_eos": True}
        try:
            await client.post("/v1/completions", json=body)
        except httpx.HTTPError:
            await asyncio.sleep(0.2)
        sent += 1
    return sent


async def replay(manager_url: str, sessions: list[Session], *, api_key: str | None = None,
                 model_map: dict[str, str] | None = None, vocab_size: int = 512, max_output_tokens: int = 16,
                 max_prompt_tokens: int = 2048, concurrency: int = 2, workers: int = 1,
                 background_prompt_tokens: int = 128, min_gap_s: float = 0.5, max_gap_s: float = 2.0,
                 timeout_s: float = 300.0) -> dict:
    """Run both policies; returns {"summary": {policy: metrics}, "calls": [...], "background_requests": n}."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=manager_url.rstrip("/"), headers=headers, timeout=timeout_s) as client:
        served = [m["id"] for m in (await client.get("/v1/models")).raise_for_status().json()["data"]]
        if model_map is None:
            recorded = list(dict.fromkeys(c.model for s in sessions for c in s.calls))
            model_map = {m: (m if m in served else served[i % len(served)]) for i, m in enumerate(recorded)}
        missing = {c.model for s in sessions for c in s.calls} - set(model_map)
        if missing:
            raise ValueError(f"model_map lacks recorded model(s) {sorted(missing)}")
        records: list[ServeCall] = []
        background = 0
        for policy in POLICIES:
            stop = asyncio.Event()
            bg = [asyncio.create_task(_background(client, served, vocab_size, background_prompt_tokens, stop, i))
                  for i in range(workers)]
            limit = asyncio.Semaphore(max(1, concurrency))

            async def one(s: Session, policy=policy) -> None:
                async with limit:
                    renamed = dataclasses.replace(s, session_id=f"{s.session_id}#{policy}", token_seed=None)
                    await _run_session(client, renamed, policy, model_map, vocab_size, max_output_tokens,
                                       max_prompt_tokens, (min_gap_s, max_gap_s), records)
            await asyncio.gather(*(one(s) for s in sessions))
            stop.set()
            background += sum(await asyncio.gather(*bg))
    return {"summary": summarize_by_policy(records), "calls": [c.as_dict() for c in records],
            "background_requests": background, "model_map": model_map}


def switch_table(summary: dict) -> str:
    """The switch-call cached-token fraction and TTFT per policy, as text."""
    lines = [f"{'policy':<10} {'switch calls':>12} {'switch cached frac':>18} {'switch TTFT mean (s)':>21}"]
    for policy in POLICIES:
        s = summary.get(policy)
        if not s:
            continue
        frac, ttft = s["switch_hit_rate"], s["switch_call_ttft_mean_s"]
        lines.append(f"{policy:<10} {s['num_switch_calls']:>12} {'-' if frac is None else f'{frac:.3f}':>18} "
                     f"{'-' if ttft is None else f'{ttft:.4f}':>21}")
    return "\n".join(lines)
