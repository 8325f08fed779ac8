"""Fixtures of the engine tests: the tiny model and a check of greedy tokens against the dense reference."""
import pytest
import torch

from shadowprefill.model.config import ModelConfig
from shadowprefill.model.llama import Llama

TIE_GAP = 1e-4   # below this logit gap, float rounding may legitimately flip the argmax


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny CPU forwards: intra-op threads only contend (40x slower on a loaded 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model():
    return Llama(ModelConfig.tiny(), seed=0)


def assert_greedy_equal(model, prompt, got):
    """Every engine token is the greedy choice of the dense reference given the prompt and the engine's own
    earlier tokens, except at a near-tie (the engine's token within TIE_GAP of the reference maximum, where
    float rounding may flip the argmax). After a tie the continuations differ, so each later token is
    checked against the reference on the engine's own prefix (teacher forcing), not on the reference's."""
    assert len(got) > 0
    seq = list(prompt)
    for i, g in enumerate(got):
        logits = model.reference_logits(seq)[-1].double()
        w = int(logits.argmax())
        if g != w:
            gap = float(logits[w] - logits[g])
            assert gap < TIE_GAP, f"token {i}: engine {g}, reference {w} (gap {gap:.2e}) after {got[:i]}"
        seq.append(int(g))
