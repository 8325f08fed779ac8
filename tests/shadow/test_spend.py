"""spend_budget (Algorithm 1 line 15, shared by the engine and the vLLM plugin): chunk sizes, order, holds."""
import pytest

from shadowprefill.shadow.controller import ShadowController
from shadowprefill.shadow.predictor import IterationPredictor
from shadowprefill.shadow.spend import spend_budget
from shadowprefill.shadow.view import IterationView

BS = 16


class TokenBudget:
    """A budget of `tokens` (time = tokens, context-free), `kv` tokens of free shadow KV: lines 10-11 by hand."""

    def __init__(self, tokens, n_min=64, kv=10**9, room=2048):
        self.left, self.n_min, self.kv, self.kv_read, self.tokens = tokens, n_min, kv, False, room
        self.taken = []

    @property
    def open(self):
        return min(self.left, self.kv, self.tokens) >= self.n_min

    def room(self):
        return min(self.tokens, self.kv) if self.kv_read else self.tokens

    def read_kv_room(self, block_size):
        self.kv_read = True
        return self.room()

    def fits(self, context, extra_s=0.0, reload=None):
        return self.left - (reload or 0)

    def take(self, tokens, context, extra_s=0.0, reload=None):
        self.left -= tokens + (reload or 0)
        self.kv -= tokens
        self.tokens -= tokens
        self.taken.append((tokens, context))


class Host:
    """Candidates are (name, context, remaining); `refuse` names whose allocation fails; logs every call."""

    block_size = BS

    def __init__(self, refuse=(), skip=()):
        self.refuse, self.skip, self.log, self.held = set(refuse), set(skip), [], set()

    def locate(self, c):
        name, context, remaining = c[:3]
        self.log.append(("locate", name))
        if name in self.skip:
            return None
        self.held.add(name)
        return context, remaining, (c[3] if len(c) > 3 else None)

    def allocate(self, c, context, n):
        self.log.append(("allocate", c[0], n))
        return c[0] not in self.refuse

    def release(self, c):
        self.log.append(("release", c[0]))
        self.held.discard(c[0])


def names(chunks):
    return [(c[0], ctx, n) for c, ctx, n in chunks]


def test_in_order_whole_pages_until_spent():
    cands = [("a", 0, 1000), ("b", 32, 1000), ("c", 0, 1000)]
    b = TokenBudget(700, n_min=64)
    out = spend_budget(b, cands, Host())
    # a: 700 -> 688 (43 pages); b: 12 left < n_min -> nothing more
    assert names(out) == [("a", 0, 688)]
    assert b.taken == [(688, 0)]
    b = TokenBudget(1200, n_min=64)
    out = spend_budget(b, cands, Host())
    assert names(out) == [("a", 0, 992), ("b", 32, 208)]      # 1200 - 992 = 208: 32 + 208 ends on a page
    out = spend_budget(TokenBudget(1200, n_min=64), [("a", 0, 1000), ("b", 40, 1000)], Host())
    assert names(out) == [("a", 0, 992), ("b", 40, 200)]      # b's context is mid-page: 40 + 200 = 240
    assert all((ctx + n) % BS == 0 for _, ctx, n in out)


def test_n_min_defers_small_chunks_and_releases_holds():
    h = Host()
    out = spend_budget(TokenBudget(100, n_min=128), [("a", 0, 1000), ("b", 0, 500)], h)
    assert out == []
    assert ("release", "a") in h.log and not h.held        # located, got nothing: holds dropped


@pytest.mark.parametrize("short_last, expect", [(True, [("b", 16, 40)]), (False, [])])
def test_short_last_chunk_only_when_it_completes(short_last, expect):
    out = spend_budget(TokenBudget(100, n_min=128), [("b", 16, 40)], Host(), short_last=short_last)
    assert names(out) == expect


def test_limit_and_probe():
    cands = [("a", 0, 1000), ("b", 0, 1000)]
    assert names(spend_budget(TokenBudget(5000, n_min=64, room=8000), cands, Host(), limit=300)) == [("a", 0, 288)]
    assert names(spend_budget(TokenBudget(5000, n_min=64, room=300), cands, Host())) == [("a", 0, 288)]
    # probe: one chunk of at most n_min whatever t̂ says (here t̂ would refuse everything)
    assert names(spend_budget(TokenBudget(0, n_min=64, kv=10**9), cands, Host(), probe=True)) == [("a", 0, 64)]
    assert names(spend_budget(TokenBudget(0, n_min=64), [("s", 0, 20)] + cands, Host(), probe=True)) == [("s", 0, 20)]


def test_refused_allocation_skips_and_releases():
    h = Host(refuse={"a"})
    out = spend_budget(TokenBudget(2000, n_min=64), [("a", 0, 512), ("b", 0, 512)], h)
    assert names(out) == [("b", 0, 512)]
    assert ("release", "a") in h.log and h.held == {"b"}


def test_locate_none_skips_without_release():
    h = Host(skip={"a"})
    out = spend_budget(TokenBudget(2000, n_min=64), [("a", 0, 512), ("b", 0, 512)], h)
    assert names(out) == [("b", 0, 512)]
    assert ("release", "a") not in h.log


def test_line_11_free_kv_caps_the_chunks():
    out = spend_budget(TokenBudget(2000, n_min=64, kv=400), [("a", 0, 1000), ("b", 0, 1000)], Host())
    assert names(out) == [("a", 0, 400)]            # 400 = 25 pages; b gets 0 < n_min


def test_reload_cost_is_charged():
    b = TokenBudget(1000, n_min=64)
    out = spend_budget(b, [("a", 64, 2000, 300)], Host())
    assert names(out) == [("a", 64, 688)]           # 1000 - 300 reload = 700: 64 + 688 ends on a page
    assert b.left == 1000 - 688 - 300


def test_estimate_skips_lookup():
    class EstHost(Host):
        def estimate(self, c):
            return c[1], c[2]
    h = EstHost()
    out = spend_budget(TokenBudget(500, n_min=64), [("a", 0, 32), ("b", 0, 400)], h, short_last=False)
    assert names(out) == [("b", 0, 400)]
    assert ("locate", "a") not in h.log              # its belief (32 < n_min) skipped the lookup


def test_bad_host_and_limit():
    class NoBS:
        pass
    with pytest.raises(ValueError, match="block_size"):
        spend_budget(TokenBudget(100), [], NoBS())
    with pytest.raises(TypeError, match="limit"):
        spend_budget(TokenBudget(100), [], Host(), limit=1.5)


class LinearLatency:
    """t = 2 ms + 20 us per prefill token + 1 ns per n(c+n): an independent t̂ to check line 10 against."""

    def iteration_time(self, prefill, decode_contexts):
        return 2e-3 + sum(2e-5 * n + 1e-9 * n * (c + n) for n, c in prefill) + 1e-4 * len(decode_contexts)


def test_real_budget_line_10_is_tight():
    """Idle branch, b = βT: every chunk keeps t̂ of the iteration within b, and one more page would not."""
    lat = LinearLatency()
    ctl = ShadowController("harvest-slo", IterationPredictor(lat, warm_steps=0, growth=None), tpot_slo=0.05, n_min=64)
    view = IterationView(now=0.0, decodes=[], prefills=[], has_routed=False, free_shadow_tokens=10**6)
    budget = ctl.plan(view)
    b = budget.seconds
    assert b == pytest.approx(0.025)
    cands = [("a", 512, 600), ("b", 0, 10**5)]
    out = spend_budget(budget, cands, Host())
    chunks = [(n, ctx) for _, ctx, n in out]
    assert chunks[0] == (592, 512)                   # a: all its whole pages (512 + 600 -> 1104)
    assert lat.iteration_time(chunks, []) <= b * (1 + 1e-6)
    ctx, n = out[-1][1], out[-1][2]
    longer = chunks[:-1] + [(n + BS, ctx)]
    assert lat.iteration_time(longer, []) > b * (1 - 1e-3)
