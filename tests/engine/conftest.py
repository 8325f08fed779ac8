"""Fixtures of the engine tests: the tiny model and an independent greedy reference."""
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


def reference_greedy(model, prompt, num_tokens):
    """Greedy decoding with the dense no-cache forward (`reference_logits`): tokens and logit rows."""
    seq, tokens, rows = list(prompt), [], []
    for _ in range(num_tokens):
        logits = model.reference_logits(seq)[-1].double()
        rows.append(logits)
        tokens.append(int(logits.argmax()))
        seq.append(tokens[-1])
    return tokens, rows


def assert_greedy_equal(model, prompt, got):
    """The engine's tokens equal greedy decoding of the dense reference. At a near-tie (the engine's
    token within TIE_GAP of the reference maximum) the continuation may legitimately differ: stop there."""
    assert len(got) > 0
    want, rows = reference_greedy(model, prompt, len(got))
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            gap = float(rows[i][w] - rows[i][g])
            assert gap < TIE_GAP, f"token {i}: engine {g}, reference {w} (gap {gap:.2e}); {got} vs {want}"
            return
