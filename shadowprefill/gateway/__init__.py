"""Unified AI Gateway (paper 003): analytic workload model, cache registry, control plane, transfer path.

    analytic       Table III defaults, §VI-B formulas, Table IV profiles, benefits(), Figure 5 sweeps
    registry       CacheRegistry: tenant-isolated, versioned, TTL / capacity / LRU
    placement      replication / migration by request frequency and transfer cost
    control_plane  ControlPlane.decide(request, candidates, constraints) -> Decision
    transfer       pack -> fp8 -> wire bytes -> unpack through shadowprefill.ops
    sites          Site, Link, Topology (End-Edge-Cloud, Eq. 1)
    cli            `shadowprefill gateway table|sweep` (register(subparsers))
    kv_events      vLLM's KV-cache event wire format (KVEventBatch over ZMQ, msgpack)
    engine_view    EngineView: one engine's events applied to the registry (per instance, per tenant)
    kv_subscriber  KVEventSubscriber: the ZMQ streams of every engine, replay on a sequence gap
    prefill_fit    FittedPrefillModel: per-instance prefill time fitted online (NNLS)

The live modules (kv_events, engine_view, kv_subscriber) need the `serve` extra (pyzmq, msgpack) and are
imported by their full names; `shadowprefill.serve.gateway_live` runs them inside `serve-manager`.
"""
from .analytic import PROFILES, AnalyticParams, WorkloadProfile, benefits
from .control_plane import (ACTIONS, AnalyticCostModel, Candidate, Constraints, ControlPlane, CostEstimator,
                            Decision, GatewayRequest, MapperRegistry, Option)
from .placement import PlacementAction, apply_placement, plan_placement
from .registry import CacheEntry, CacheLayout, CacheRegistry, Location, PrefixHit
from .sites import Link, Site, Topology

__all__ = ["PROFILES", "AnalyticParams", "WorkloadProfile", "benefits", "ACTIONS", "AnalyticCostModel",
           "Candidate", "Constraints", "ControlPlane", "CostEstimator", "Decision", "GatewayRequest",
           "MapperRegistry", "Option", "CacheEntry", "CacheLayout", "CacheRegistry", "Location",
           "PlacementAction", "apply_placement", "plan_placement", "PrefixHit", "Link", "Site", "Topology"]
