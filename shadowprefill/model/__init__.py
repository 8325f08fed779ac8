"""Llama-style decoder on the shadowprefill ops, its configs and the paper's model catalog."""
from .config import ModelConfig, RopeScaling
from .forward_batch import ForwardBatch
from .llama import Llama
from .weights import load_checkpoint, read_config, save_checkpoint

__all__ = ["ModelConfig", "RopeScaling", "ForwardBatch", "Llama", "load_checkpoint", "read_config", "save_checkpoint"]
