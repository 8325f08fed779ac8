"""Write the random-weight Llama checkpoints the vLLM harness serves (run with the project's venv).

    python tests/vllm_harness/build_models.py OUT_DIR

OUT_DIR/small and OUT_DIR/large (the manager suite's two models) and OUT_DIR/medium (the ShadowScheduler
latency scenario): Hugging Face checkpoints (config.json + model.safetensors), head_dim >= 32 (vLLM's CPU
attention supports head sizes from 32 up), vocabulary 512, bfloat16. The tokenizer is added by
train_tokenizer.py (run with the vLLM venv).
"""
import sys
from pathlib import Path

import torch

from shadowprefill.model import Llama, ModelConfig, save_checkpoint

SHAPES = {
    "small": ModelConfig.tiny(hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256),
    "large": ModelConfig.tiny_large(hidden_size=256, num_heads=8, num_kv_heads=2, head_dim=32,
                                    intermediate_size=512),
    # the ShadowScheduler latency scenario: heavy enough that a 2048-token prefill step takes about a second
    # on 2 CPU cores while a decode step stays in the tens of milliseconds
    "medium": ModelConfig.tiny_large(hidden_size=384, num_layers=6, num_heads=6, num_kv_heads=2, head_dim=64,
                                     intermediate_size=1024, name="medium"),
}

if __name__ == "__main__":
    out = Path(sys.argv[1])
    for seed, (name, config) in enumerate(SHAPES.items()):
        save_checkpoint(Llama(config, seed=seed), out / name, dtype=torch.bfloat16)
        print(f"[vllm-harness] wrote {out / name} ({config.num_params / 1e6:.2f}M parameters)")
