import pytest


def pytest_collection_modifyitems(items):
    """The engines here run with secure_mode off on purpose (seeded oracles)."""
    for item in items:
        if "privacy_units" in str(item.fspath):
            item.add_marker(pytest.mark.filterwarnings("ignore::opacus_dp.engine.private_step.SecureModeNotice"))
