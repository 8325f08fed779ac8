"""Configuration of the vLLM shadow scheduler, read from the environment variable `SHADOWPREFILL_VLLM`.

The variable holds a JSON object, or the path of a file holding one:

    SHADOWPREFILL_VLLM='{"tpot_slo_s": 0.1, "n_min": 32, "stats_path": "/tmp/shadow-steps.jsonl"}'

| key             | default        | meaning                                                                   |
|-----------------|----------------|---------------------------------------------------------------------------|
| shadow_priority | 1000           | requests with `priority >= shadow_priority` are shadow work               |
| routed_priority | 0              | requests with `priority <= routed_priority` are routed calls (Alg. 1 l.5) |
| policy          | "harvest-slo"  | "harvest-slo" (Eq. 1 slack, credit beside routed calls) or "harvest"      |
| tpot_slo_s      | paper's rule   | T: max(25 ms, 5 x t̂ of a batch-1 decode at 1K context), from vLLM's steps |
| ttft_slo_s      | paper's rule   | F: max(1 s, 5 x t̂ of the prompt's isolated prefill), per request         |
| beta            | 0.5            | idle cap βT                                                               |
| delta           | policy default | credit rate δ (harvest-slo 0.025, harvest 0.1)                            |
| margin          | 0.1            | SLO margin m of Eq. 1                                                     |
| n_min           | 256            | smallest shadow chunk (Alg. 1 line 12)                                    |
| shadow_fraction | 0.25           | cap on shadow KV, a fraction of vLLM's KV blocks (§3.3)                   |
| cold_age_s      | 5.0            | a shadow chunk may take only free blocks or cached blocks idle this long  |
| warmup_steps    | 16             | measured steps (half of them decode-only) before T is fixed by the rule;  |
|                 |                | t̂ is trusted after 8 measured steps with prefill tokens (predictor.py);   |
|                 |                | until both, n_min probes on idle steps only                               |
| stats_path      | none           | one JSON line per scheduler step (and /metrics counters, see metrics.py)  |

A bad key or value raises `ValueError` naming it; vLLM then stops at start-up. This module imports nothing
from vLLM (it is tested in the project's own venv).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path

from shadowprefill.shadow.policy import ShadowSettings

ENV_VAR = "SHADOWPREFILL_VLLM"
POLICIES = ("harvest-slo", "harvest")


def _integer(name: str, value, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{ENV_VAR}: {name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{ENV_VAR}: {name} must be >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class ShadowSchedulerConfig(ShadowSettings):
    """The scheduler's settings (see the module docstring for each key): the controller's, declared once in
    `shadow.policy.ShadowSettings` for the engine and this plugin, and the plugin's own."""

    shadow_priority: int = 1000
    routed_priority: int = 0
    policy: str = "harvest-slo"
    warmup_steps: int = 16
    stats_path: str | None = None

    def __post_init__(self) -> None:
        try:
            super().__post_init__()
        except (TypeError, ValueError) as e:               # one error type for a bad value, naming the variable
            raise ValueError(f"{ENV_VAR}: {e}") from None
        for name in ("shadow_priority", "routed_priority"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                raise ValueError(f"{ENV_VAR}: {name} must be an integer, got {getattr(self, name)!r}")
        if self.routed_priority >= self.shadow_priority:
            raise ValueError(f"{ENV_VAR}: routed_priority ({self.routed_priority}) must be below shadow_priority "
                             f"({self.shadow_priority})")
        if self.policy not in POLICIES:
            raise ValueError(f"{ENV_VAR}: policy must be one of {POLICIES}, got {self.policy!r}")
        _integer("warmup_steps", self.warmup_steps, minimum=0)
        if self.stats_path is not None:
            if not isinstance(self.stats_path, str) or not self.stats_path:
                raise ValueError(f"{ENV_VAR}: stats_path must be a non-empty string, got {self.stats_path!r}")
            parent = Path(self.stats_path).expanduser().parent
            if not parent.is_dir():
                raise ValueError(f"{ENV_VAR}: stats_path {self.stats_path!r}: directory {str(parent)!r} does not exist")

    @classmethod
    def from_dict(cls, d) -> "ShadowSchedulerConfig":
        """From a parsed JSON object; unknown keys are an error (naming them)."""
        if not isinstance(d, dict):
            raise ValueError(f"{ENV_VAR} must hold a JSON object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{ENV_VAR}: unknown key(s) {', '.join(map(repr, unknown))}; known keys: "
                             f"{', '.join(sorted(known))}")
        return cls(**d)

    @classmethod
    def from_env(cls, environ=None) -> "ShadowSchedulerConfig":
        """From `SHADOWPREFILL_VLLM` (a JSON object or a path to a JSON file); defaults if unset or empty."""
        raw = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
        if not raw:
            return cls()
        if raw.startswith("{"):
            text, where = raw, ENV_VAR
        else:
            path = Path(raw).expanduser()
            if not path.is_file():
                raise ValueError(f"{ENV_VAR}: not a JSON object and not a readable file: {raw!r}")
            text, where = path.read_text(), f"{ENV_VAR} file {str(path)!r}"
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: invalid JSON ({e})") from None
        return cls.from_dict(d)
