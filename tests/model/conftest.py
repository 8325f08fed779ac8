"""Model tests run tiny matrices: one intra-op thread is faster than two on the shared 2-core machine
(measured: 10 s instead of 60 s for tests/model under load), and is restored afterwards."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
