"""Sessions, workloads, per-step routers and the cluster manager."""
from .router import CallableRouter, MarkovRouter, RandomRouter, ReplayRouter, SwitchPredictor
from .traces import load_sessions, normal_traffic, save_sessions
from .workloads import WORKLOADS, Call, Session, generate_sessions

__all__ = ["Call", "Session", "generate_sessions", "WORKLOADS", "load_sessions", "save_sessions", "normal_traffic",
           "ReplayRouter", "MarkovRouter", "RandomRouter", "CallableRouter", "SwitchPredictor"]
