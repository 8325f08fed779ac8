"""Continuous-batching engine: requests, scheduler, executors (model | simulated), predictor, engine loop."""
from .clock import Clock, VirtualClock, WallClock
from .config import EngineConfig
from .executor import ExecuteResult, Executor, ModelExecutor, SimulatedExecutor
from .llm_engine import Iteration, LLMEngine
from .request import Priority, Request, RequestOutput, RequestStatus
from .scheduler import ScheduledBatch, Scheduler

__all__ = ["Clock", "VirtualClock", "WallClock", "EngineConfig", "ExecuteResult", "Executor", "ModelExecutor",
           "SimulatedExecutor", "Iteration", "LLMEngine", "Priority",
           "Request", "RequestOutput", "RequestStatus", "ScheduledBatch", "Scheduler"]
