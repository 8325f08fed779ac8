"""The control plane's shadow dispatch (`ControlPlane.plan_shadows`) against a computation written here:
Table III's prefill time, the coverage the test put in the registry, the benefit rule and its reasons."""
import math
import random

import pytest

from shadowprefill.gateway.control_plane import ControlPlane, ShadowCandidate
from shadowprefill.gateway.prefill_fit import FittedPrefillModel
from shadowprefill.gateway.registry import CacheLayout, CacheRegistry, Location

BS = 16
A_MS, B_MS, TAU_MS = 0.04, 3e-6, 20.0               # Table III, written out here


def t_ref(n, m):
    return (A_MS * (n - m) + B_MS * (n * n - m * m) + TAU_MS) / 1e3


def reference(cands, held, kappa):
    """(chosen?, reason kind) per candidate, by the rule of gateway.shadow_plan written as a loop."""
    rows = []
    for c in cands:
        n = len(c.history)
        w = n // BS * BS
        m = min(held.get(c.site, 0), w)
        rows.append((c, n, w, m))
    base = {}
    for c, n, w, m in rows:
        if not c.unavailable:
            base[c.model_id] = min(base.get(c.model_id, math.inf), t_ref(n, m))
    out = []
    for c, n, w, m in rows:
        if c.unavailable:
            out.append(("unavailable", None))
        elif w == 0:
            out.append(("short", None))
        elif m >= w:
            out.append(("held", None))
        else:
            b = c.switch_prob * (base[c.model_id] - t_ref(n, w)) - kappa * (1 + c.waiting) * (t_ref(w, m) - t_ref(w, w))
            out.append(("benefit" if b > 0 else "nonpositive", b))
    verdict = [k for k, _ in out]
    for model in {c.model_id for c in cands}:
        idx = [i for i, (k, _) in enumerate(out) if k == "benefit" and cands[i].model_id == model]
        if idx:
            best = max(idx, key=lambda i: (out[i][1], -i))
            for i in idx:
                verdict[i] = "chosen" if i == best else "larger"
    return verdict, [b for _, b in out]


@pytest.mark.parametrize("seed", range(12))
def test_plan_matches_the_reference(seed):
    rng = random.Random(seed)
    reg = CacheRegistry()
    plane = ControlPlane(registry=reg, estimator=FittedPrefillModel(), overhead_s=0.0)
    models = ["m1", "m2", "m3"][: rng.randint(1, 3)]
    kappa = rng.choice([0.0, 0.05, 0.1, 0.3, 1.0])
    cands, held = [], {}
    history = {m: [rng.randrange(1, 5000) for _ in range(rng.choice([8, 40, 200, 700]))] for m in models}
    for model in models:
        p = rng.random()
        for e in range(rng.randint(1, 3)):
            site = f"http://{model}-{e}"
            ids = history[model]
            k = rng.randint(0, len(ids) // BS)          # whole blocks this site holds (0: none)
            if k and rng.random() < 0.7:
                reg.insert("t", model, "v", ids[:k * BS], CacheLayout(BS, 1, 1, 1), Location(site))
                held[site] = k * BS
            other_tenant = rng.random() < 0.2           # another tenant's copy is never coverage
            if other_tenant:
                reg.insert("u", model, "v", ids[:len(ids) // BS * BS] or ids * BS, CacheLayout(BS, 1, 1, 1),
                           Location(site))
            unavailable = rng.choice(["", "", "", "down: refused", "stale: silent"])
            cands.append(ShadowCandidate(model, site, p, ids, BS, waiting=float(rng.choice([0, 0, 1, 5])),
                                         unavailable=unavailable))
    plan = plane.plan_shadows("t", cands, kappa)
    verdict, benefit = reference(cands, held, kappa)
    assert [(v.model_id, v.site) for v in plan] == [(c.model_id, c.site) for c in cands]
    for v, c, kind, b in zip(plan, cands, verdict, benefit):
        assert v.cached_tokens == min(held.get(c.site, 0), len(c.history) // BS * BS)
        assert v.chosen == (kind == "chosen"), (kind, v)
        if kind == "unavailable":
            assert v.reason == c.unavailable
        elif kind == "short":
            assert v.reason.startswith("history of") and "shorter than one block" in v.reason
        elif kind == "held":
            assert v.reason.startswith("held:")
        elif kind == "nonpositive":
            assert v.reason.startswith("expected benefit") and v.benefit_s == pytest.approx(b, abs=1e-12)
        elif kind == "larger":
            assert v.reason.endswith("has the larger benefit")
        else:
            assert v.reason == "" and v.benefit_s == pytest.approx(b, abs=1e-12) and b > 0
    for model in models:                                   # at most one instance per model
        assert sum(v.chosen for v in plan if v.model_id == model) <= 1


def test_plan_cases_by_hand():
    """Held by the registry, guessed coverage, a busy queue and a zero probability, each once."""
    rng = random.Random(5)
    reg = CacheRegistry()
    plane = ControlPlane(registry=reg, overhead_s=0.0)
    ids = [rng.randrange(1, 999) for _ in range(10 * BS + 3)]
    reg.insert("t", "m", "v", ids[:10 * BS], CacheLayout(BS, 1, 1, 1), Location("held"))
    plan = plane.plan_shadows("t", [ShadowCandidate("m", "held", 0.5, ids, BS),
                                    ShadowCandidate("m", "cold", 0.5, ids, BS)], 0.1)
    assert plan[0].reason.startswith("held:") and not plan[1].chosen
    assert plan[1].reason.startswith("expected benefit")      # the held site already saves it all
    plan = plane.plan_shadows("t", [ShadowCandidate("m", "g", 0.5, 300, cached_tokens=100),
                                    ShadowCandidate("m", "busy", 0.5, ids, BS, waiting=9.0),
                                    ShadowCandidate("x", "never", 0.0, ids, BS)], 0.1)
    assert plan[0].chosen and plan[0].cached_tokens == 100 and plan[0].warm_tokens == 300
    assert not plan[1].chosen and plan[1].reason.startswith("expected benefit")   # 0.5 < 0.1 x (1 + 9)
    assert not plan[2].chosen and plan[2].reason.startswith("expected benefit")


@pytest.mark.parametrize("kw, field", [({"switch_prob": 1.5}, "switch_prob"), ({"block_size": 0}, "block_size"),
                                       ({"waiting": -1.0}, "waiting")])
def test_shadow_candidate_rejects_bad_fields(kw, field):
    with pytest.raises(ValueError, match=field):
        ShadowCandidate(**{"model_id": "m", "site": "s", "switch_prob": 0.5, "history": [1], **kw})


def test_plan_rejects_bad_arguments():
    plane = ControlPlane()
    with pytest.raises(ValueError, match="cost_ratio"):
        plane.plan_shadows("t", [], -1.0)
    with pytest.raises(TypeError, match="ShadowCandidate"):
        plane.plan_shadows("t", [("m", "s")])
