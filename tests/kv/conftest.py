import pytest


@pytest.fixture(params=["python", "native"])
def kv_backend(request, monkeypatch):
    """Run a test on both KV cores: managers and host tiers made without backend= take this one."""
    monkeypatch.setenv("SHADOWPREFILL_KV_BACKEND", request.param)
    return request.param
