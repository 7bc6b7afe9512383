"""The secure_mode reminder: a typed warning (filterable as such), from rank 0 only under
torch.distributed, never when secure_mode is on."""

import warnings

import pytest
import torch.distributed as dist

from opacus_dp import PrivacyEngine
from opacus_dp.engine.private_step import SecureModeNotice


def _notices(**engine_kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        PrivacyEngine(**engine_kwargs)
    return [w for w in caught if issubclass(w.category, SecureModeNotice)]


def test_the_notice_is_a_user_warning_of_its_own_type():
    notices = _notices()
    assert len(notices) == 1 and issubclass(SecureModeNotice, UserWarning)
    assert "secure_mode=True" in str(notices[0].message)


def test_no_notice_in_secure_mode():
    assert _notices(secure_mode=True) == []


@pytest.mark.parametrize("rank,expected", [(0, 1), (1, 0), (3, 0)])
def test_only_rank_zero_reminds(monkeypatch, rank, expected):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: rank)
    assert len(_notices()) == expected
