#!/usr/bin/env bash
# The live gateway against real vLLM servers with KV-cache events on (issue 22): three servers — `small` (A),
# `small` with an 80-block KV pool (B, evictions) and `large` (L) — each publishing KVEventBatch over ZMQ to
# an endpoint the manager binds (vLLM connects to a non-wildcard address) with its own replay socket; then
# tests/vllm_harness/suite_gateway.py (the manager in-process), after units_kv_events_interop.py (vLLM's own
# publisher class against the gateway's subscriber, no model). Servers are killed on exit.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
PY="${PY:-$ROOT/.venv/bin/python}"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
WORK="${VLLM_HARNESS_WORK:-$ROOT/.venv-vllm/harness}"
mkdir -p "$WORK"
if [[ ! -f "$WORK/models/small/tokenizer.json" ]]; then
  "$PY" tests/vllm_harness/build_models.py "$WORK/models"
  "$VENV/bin/python" tests/vllm_harness/train_tokenizer.py "$WORK/models/small" "$WORK/models/large" "$WORK/models/medium"
fi
# the subscriber against vLLM's own ZmqEventPublisher first (wire format, wildcard bind, replay of a gap)
VLLM_VENV="$VENV" "$PY" -m pytest -q tests/vllm_harness/units_kv_events_interop.py
source tests/vllm_harness/servers.sh
events() {  # pub-port replay-port -> --kv-events-config JSON
  echo "{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://127.0.0.1:$1\", \"replay_endpoint\": \"tcp://127.0.0.1:$2\", \"topic\": \"kv\"}"
}
P_A=$(free_port); P_B=$(free_port); P_L=$(free_port)
E_A=$(free_port); R_A=$(free_port); E_B=$(free_port); R_B=$(free_port); E_L=$(free_port); R_L=$(free_port)
export VLLM_SERVER_DEV_MODE=1            # exposes POST /reset_prefix_cache
OMP_NUM_THREADS=1 start_server gw-a small "$P_A" "" --kv-events-config "$(events "$E_A" "$R_A")"
OMP_NUM_THREADS=1 start_server gw-b small "$P_B" "" --kv-events-config "$(events "$E_B" "$R_B")" "${PRESSURE_ARGS[@]}"
OMP_NUM_THREADS=1 start_server gw-l large "$P_L" "" --kv-events-config "$(events "$E_L" "$R_L")"
wait_ready "$P_A" "$P_B" "$P_L"
cat > "$WORK/gateway-peers.json" <<JSON
{"block_size": 32, "pressure_blocks": 80, "servers": {
  "a": {"model": "small", "url": "http://127.0.0.1:$P_A", "pid": ${PIDS[0]}, "events": "tcp://127.0.0.1:$E_A", "replay": "tcp://127.0.0.1:$R_A"},
  "b": {"model": "small", "url": "http://127.0.0.1:$P_B", "pid": ${PIDS[1]}, "events": "tcp://127.0.0.1:$E_B", "replay": "tcp://127.0.0.1:$R_B"},
  "l": {"model": "large", "url": "http://127.0.0.1:$P_L", "pid": ${PIDS[2]}, "events": "tcp://127.0.0.1:$E_L", "replay": "tcp://127.0.0.1:$R_L"}}}
JSON
SP_GATEWAY_PEERS="$WORK/gateway-peers.json" SP_GATEWAY_REPORT="$WORK/gateway-report.json" \
  "$PY" -m pytest -q -s tests/vllm_harness/suite_gateway.py
kill_servers
