"""cluster.link: one Link (paper 003 Eq. 1) and the FIFO of transfers over it (P/D inbound links)."""
import random

import pytest

from shadowprefill.cluster.link import Link, LinkQueue


def test_transfer_time_is_eq1():
    link = Link(8e9, rtt_s=0.02, queue_s=0.005)
    assert link.transfer_time_s(4e9) == pytest.approx(0.5 + 0.02 + 0.005)
    assert link.transfer_time_s(0) == pytest.approx(0.025)


def test_fifo_queue_against_a_hand_simulation():
    rng = random.Random(5)
    link = Link(3e9, rtt_s=0.001)
    q = LinkQueue(link)
    free = 0.0
    now = 0.0
    for _ in range(200):
        now += rng.expovariate(2.0)
        nbytes = rng.uniform(1e6, 2e9)
        start = now if now > free else free                 # waits for the transfer ahead of it
        free = start + nbytes / 3e9 + 0.001
        assert q.reserve(now, nbytes) == pytest.approx(free, rel=1e-12)
    assert q.free_at == pytest.approx(free)
    assert q.busy_s > 0 and q.bytes_moved > 200 * 1e6


@pytest.mark.parametrize("kwargs, name", [({"bandwidth_bytes_per_s": 0}, "bandwidth"),
                                          ({"bandwidth_bytes_per_s": 1e9, "rtt_s": -1}, "rtt_s"),
                                          ({"bandwidth_bytes_per_s": 1e9, "price_per_byte": -1}, "price")])
def test_bad_links(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Link(**kwargs)
    with pytest.raises(ValueError, match="nbytes"):
        Link(1e9).transfer_time_s(-1)
    with pytest.raises(TypeError, match="link"):
        LinkQueue(1e9)
