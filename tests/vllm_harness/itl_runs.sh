#!/usr/bin/env bash
# Repeat the itl scenario (the issue-21 reproduction: three streaming clients, three 1,500-token shadows,
# T = TPOT_SLO_S, default 0.03) on stock vLLM and on vLLM with ShadowScheduler (both serving MODEL, default
# `small`, float32, as run.sh's itl servers), alternating,
# and print one table row per peer and run (the README's measured table). After `make test-vllm` built the
# venvs and models.     RUNS=3 NICE=-5 bash tests/vllm_harness/itl_runs.sh
# NICE (optional): the servers' and the client's nice value, for measuring on a machine shared with other jobs.
# OMP_NUM_THREADS (default 1, as run.sh's latency servers): see run.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
PY="${PY:-$ROOT/.venv/bin/python}"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
WORK="${VLLM_HARNESS_WORK:-$ROOT/.venv-vllm/harness}/itl-runs"
RUNS="${RUNS:-3}"
MODEL="${MODEL:-small}"
TPOT_SLO_S="${TPOT_SLO_S:-0.03}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
mkdir -p "$WORK"
ln -sfn "$(dirname "$WORK")/models" "$WORK/models"
rm -f "$WORK"/*.json "$WORK/steps.jsonl"
source tests/vllm_harness/servers.sh
P_STOCK=$(free_port); P_PLUGIN=$(free_port)
start_server stock-$MODEL "$MODEL" "$P_STOCK" "" --dtype float32
start_server plugin-$MODEL "$MODEL" "$P_PLUGIN" "{\"n_min\": 32, \"tpot_slo_s\": $TPOT_SLO_S, \"stats_path\": \"$WORK/steps.jsonl\"}" --scheduler-cls "$SCHED" --dtype float32
wait_ready "$P_STOCK" "$P_PLUGIN"
FILES=()
for k in $(seq 1 "$RUNS"); do
  for peer in stock plugin; do
    port=$P_STOCK; [[ $peer == plugin ]] && port=$P_PLUGIN
    ${NICE:+nice -n "$NICE"} "$PY" tests/vllm_harness/shadow_scenario.py itl --url "http://127.0.0.1:$port" --model "$MODEL" \
      --shadows 3 --shadow-len 1500 --streams 3 --seed "$k" --out "$WORK/$peer-$k.json" > /dev/null
  done
  FILES+=("$WORK/stock-$k.json" "$WORK/plugin-$k.json")
  [[ $k == 1 ]] && FILES+=("$WORK/steps.jsonl")
done
"$PY" tests/vllm_harness/shadow_table.py --runs "${FILES[@]}"
