"""Shadow-job rules (shadow/jobs.py) against naive references on random histories: the longest common prefix
and supersession (an extension keeps all progress, a rewrite keeps only whole pages of the common prefix)."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shadowprefill.shadow.jobs import check_switch_prob, common_prefix_length, supersede

BS = 16


def naive_lcp(a, b):
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=80), st.lists(st.integers(0, 3), max_size=80))
def test_common_prefix_length_matches_naive(a, b):
    assert common_prefix_length(a, b) == naive_lcp(a, b)
    assert common_prefix_length(a, a + b) == len(a)


def test_supersede_matches_a_naive_rule_on_random_histories():
    rng = random.Random(3)
    for _ in range(400):
        old = [rng.randrange(3) for _ in range(rng.randrange(0, 120))]
        cached = rng.randrange(0, len(old) // BS + 1) * BS
        if rng.random() < 0.4:
            new = old + [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        else:
            cut = rng.randrange(len(old) + 1)
            new = old[:cut] + [rng.randrange(3) for _ in range(rng.randrange(0, 60))]
        kept, after, rewritten = supersede(old, new, cached, BS)
        extension = new[:len(old)] == old
        assert rewritten == (not extension)
        lcp = naive_lcp(old, new)
        assert kept == lcp and new[:kept] == old[:kept]
        assert after == (cached if extension else min(cached, lcp // BS * BS))
        assert after % BS == 0 and after <= cached


def test_switch_prob_validation():
    assert check_switch_prob(1) == 1.0
    with pytest.raises(ValueError, match="switch_prob"):
        check_switch_prob(1.5)
    with pytest.raises(TypeError, match="switch_prob"):
        check_switch_prob(True)
