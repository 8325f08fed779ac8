"""Sessions, workloads, per-step routers, the next-model prior and the orchestration core."""
from .prior import SwitchPredictor
from .router import CallableRouter, MarkovRouter, RandomRouter, ReplayRouter
from .traces import load_sessions, normal_traffic, save_sessions
from .workloads import WORKLOADS, Call, Session, generate_sessions

__all__ = ["Call", "Session", "generate_sessions", "WORKLOADS", "load_sessions", "save_sessions", "normal_traffic",
           "ReplayRouter", "MarkovRouter", "RandomRouter", "CallableRouter", "SwitchPredictor"]
