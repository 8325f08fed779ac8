"""Discrete-event simulator: roofline latency model, policies of the paper's Table 2, metrics."""
from .gpus import GPUS, get_gpu
from .latency import LatencyModel, linear_ops_ms

__all__ = ["GPUS", "get_gpu", "LatencyModel", "linear_ops_ms"]
