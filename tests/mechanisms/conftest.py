import pytest


@pytest.fixture(autouse=True)
def strategy_cache(tmp_path_factory, monkeypatch):
    """Strategies optimised by the tests are cached in a temporary directory."""
    monkeypatch.setenv("OPACUS_DP_CACHE_DIR", str(tmp_path_factory.mktemp("strategies")))
