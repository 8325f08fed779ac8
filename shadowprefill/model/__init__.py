"""Llama-style decoder on the shadowprefill ops, its configs, the paper's model catalog and the roofline
latency model (appendix B) every engine's predictor is seeded from.

Names are imported on first use, so `from shadowprefill.model.latency import LatencyModel` (the vLLM plugin,
the simulator) does not load the model code and its torch ops.
"""
from __future__ import annotations

import importlib

_WHERE = {
    "ModelConfig": ".config", "RopeScaling": ".config", "ForwardBatch": ".forward_batch", "GPUS": ".gpus",
    "get_gpu": ".gpus", "LatencyModel": ".latency", "linear_ops_ms": ".latency", "Llama": ".llama",
    "load_checkpoint": ".weights", "read_config": ".weights", "save_checkpoint": ".weights",
}

__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'shadowprefill.model' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    globals()[name] = value
    return value
