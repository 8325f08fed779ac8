"""Llama-style decoder on the shadowprefill ops, its configs, the paper's model catalog and the roofline
latency model (appendix B) every engine's predictor is seeded from."""
from .config import ModelConfig, RopeScaling
from .forward_batch import ForwardBatch
from .gpus import GPUS, get_gpu
from .latency import LatencyModel, linear_ops_ms
from .llama import Llama
from .weights import load_checkpoint, read_config, save_checkpoint

__all__ = ["ModelConfig", "RopeScaling", "ForwardBatch", "GPUS", "get_gpu", "LatencyModel", "linear_ops_ms", "Llama", "load_checkpoint", "read_config", "save_checkpoint"]
