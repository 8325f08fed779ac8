# Sourced by run.sh and itl_runs.sh: start / wait for / kill vLLM servers of the harness.
# Needs ROOT, PY, VENV, WORK. Servers run in their own process groups (setsid); PIDS holds them.
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PIDS=()
# each server runs in its own process group (setsid): killing the group also ends vLLM's EngineCore and
# worker processes, which outlive a killed API server otherwise
kill_servers() { for p in "${PIDS[@]}"; do kill -9 -- "-$p" 2>/dev/null || kill -9 "$p" 2>/dev/null || true; done; PIDS=(); }
trap kill_servers EXIT

SCHED=shadowprefill.integrations.vllm.ShadowScheduler
PRESSURE_ARGS=(--kv-cache-memory-bytes 1310720 --max-model-len 2048)    # 80 blocks of 32 tokens (small)
start_server() {  # label model port shadowprefill-config-or-empty [extra vllm args...]; pid appended to PIDS
  local label="$1" model="$2" port="$3" config="$4"; shift 4
  # VLLM_TARGET_DEVICE=cpu: belt and braces for the platform detection that the +cpu shim also fixes
  SHADOWPREFILL_VLLM="$config" VLLM_TARGET_DEVICE=cpu VLLM_CPU_OMP_THREADS_BIND=nobind ${NICE:+nice -n "$NICE"} setsid \
    "$VENV/bin/vllm" serve "$WORK/models/$model" \
    --host 127.0.0.1 --port "$port" --served-model-name "$model" \
    --enforce-eager --enable-prefix-caching --scheduling-policy priority --enable-prompt-tokens-details \
    --block-size 32 --kv-cache-memory-bytes 268435456 --dtype bfloat16 --max-model-len 4096 "$@" \
    > "$WORK/vllm-$label.log" 2>&1 &
  PIDS+=("$!")
}
wait_ready() {  # port...
  for port in "$@"; do
    for i in $(seq 1 300); do
      if "$PY" -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$port/health', timeout=1).status_code != 200)" 2>/dev/null; then
        echo "[vllm-harness] vLLM on :$port ready after ~${i}s"; break; fi
      for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null || { echo "[vllm-harness] a vLLM server died:"; tail -40 "$WORK"/vllm-*.log; exit 1; }; done
      sleep 1
      [[ $i == 300 ]] && { echo "[vllm-harness] vLLM on :$port not ready in 300 s"; tail -40 "$WORK"/vllm-*.log; exit 1; }
    done
  done
}
