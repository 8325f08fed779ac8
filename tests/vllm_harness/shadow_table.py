"""Print the README's ShadowScheduler table from the suite's report (SP_SHADOW_REPORT of run.sh), or from
itl_runs.sh's run files.

    python tests/vllm_harness/shadow_table.py REPORT.json
    python tests/vllm_harness/shadow_table.py --runs STOCK.json PLUGIN.json STATS.jsonl [STOCK2.json PLUGIN2.json ...]
"""
import json
import sys


def step_stats(stats_path: str, result: dict) -> dict:
    """Shadow tokens per step of the plugin's steps in one itl run (its shadow window, until the last
    shadow finished), from the scheduler's stats file."""
    t0 = result["window"]["shadow"][0] + result["clock_offset"]
    t1 = t0 + result["shadows_end_s"]
    rows = [json.loads(line) for line in open(stats_path)]
    rows = [r for r in rows if t0 <= r["t"] <= t1 and r["shadow_tokens"] > 0]
    return {"shadow_steps": len(rows), "shadow_tokens_max": max((r["shadow_tokens"] for r in rows), default=0),
            "shadow_tokens_mean": sum(r["shadow_tokens"] for r in rows) / max(1, len(rows)),
            "tpot_slo_s": rows[-1]["tpot_slo_s"] if rows else None}


def ms(x):
    return "-" if x is None else f"{x * 1e3:.0f}"


def row(peer: str, r: dict, per_step: str) -> str:
    sw = r["switches"]
    frac = sum(s["cached_tokens"] for s in sw) / sum(s["prompt_tokens"] for s in sw)
    ttft = sum(s["ttft_s"] for s in sw) / len(sw)
    b, d, c = r["itl_baseline"], r["itl_shadow"], r["client_itl_shadow"]
    return (f"| {peer} | {ms(b['p50'])} / {ms(b['p99'])} | {ms(d['p50'])} / {ms(d['p99'])} ({d['n']} gaps) | "
            f"{ms(c['p99'])} | {r['shadows_end_s']:.1f} | {ms(ttft)} | {frac:.3f} | {per_step} |")


def main(path: str) -> None:
    rep = json.loads(open(path).read())
    stock, plugin = rep["stock"]["itl"], rep["plugin"]["itl"]
    st = plugin["stats"]
    print("| peer | ITL p50 / p99 (ms), no shadows | ITL p50 / p99 (ms), shadows pending | client-seen ITL p99 "
          "(ms), shadows pending | shadows done after (s) | switch-call TTFT mean (ms) | switch cached-token "
          "fraction | shadow tokens per step |")
    print("|---|---|---|---|---|---|---|---|")
    print(row("vLLM 0.32 CPU, priority scheduling", stock, "up to 2048 (vLLM's chunk), not observable"))
    print(row(f"vLLM 0.32 CPU + ShadowScheduler (T = {st['tpot_slo_s'] * 1e3:.0f} ms)", plugin,
              f"mean {st['shadow_tokens_mean']:.0f}, max {st['shadow_tokens_max']} ({st['shadow_steps']} steps)"))
    if st.get("shadow_step_s"):
        print(f"plugin: shadow-carrying steps measured / b: p50 {st['duration_over_b_p50']:.2f}, max "
              f"{st['duration_over_b_max']:.2f} over {len(st['shadow_step_s'])} steps ({st['overruns']} past 1.5 b); "
              f"chunks per shadow {st['chunks_per_shadow']}")
    for name in ("stock", "plugin"):
        e, y = rep[name]["evict"], rep[name]["yield"]
        print(f"{name}: pressure ({e['num_gpu_blocks']} blocks): normal prefix cached after {e['normal_cached_after']}"
              f"/{e['blocks_a'] * e['block_size']} tokens, shadow {e['shadow_cached_after']}"
              f"/{e['blocks_a'] * e['block_size']}; waiting normal request done before the running shadow: "
              f"{y['normal_done_first']} (normal {y['normal_s']:.2f} s, shadow {y['shadow_s']:.2f} s)")


def runs(files: list[str]) -> None:
    stats_path, pairs = files[2], [files[:2]] + [files[i:i + 2] for i in range(3, len(files), 2)]
    header = True
    for k, (stock_f, plugin_f) in enumerate(pairs):
        stock, plugin = json.load(open(stock_f)), json.load(open(plugin_f))
        st = step_stats(stats_path, plugin)
        if header:
            print("| run | peer | ITL p50 / p99 (ms), no shadows | ITL p50 / p99 (ms), shadows pending | client-seen ITL "
                  "p99 (ms), shadows pending | shadows done after (s) | switch-call TTFT mean (ms) | switch "
                  "cached-token fraction | shadow tokens per step |")
            print("|---|---|---|---|---|---|---|---|---|")
            header = False
        print(f"| {k + 1} " + row("vLLM 0.32 CPU, priority scheduling", stock, "up to 2048 (not observable)"))
        print(f"| {k + 1} " + row(f"+ ShadowScheduler (T = {st['tpot_slo_s'] * 1e3:.0f} ms)", plugin,
                                  f"mean {st['shadow_tokens_mean']:.0f}, max {st['shadow_tokens_max']} "
                                  f"({st['shadow_steps']} steps)"))


if __name__ == "__main__":
    if sys.argv[1] == "--runs":
        runs(sys.argv[2:])
    else:
        main(sys.argv[1])
