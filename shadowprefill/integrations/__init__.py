"""Integrations of shadow prefill into other serving engines (`integrations.vllm`: a vLLM scheduler class)."""
