"""Opacus-compatible import paths of the privacy analysis."""

import numpy as np
import pytest


def test_classic_privacy_analysis_module_with_positional_arguments():
    from opacus_dp import privacy_analysis

    rdp = privacy_analysis.compute_rdp(0.01, 1.1, 1000, privacy_analysis.DEFAULT_ALPHAS)
    eps, alpha = privacy_analysis.get_privacy_spent(privacy_analysis.DEFAULT_ALPHAS, rdp, 1e-5)
    from opacus.accountants.analysis import rdp as opacus_rdp

    ref_rdp = opacus_rdp.compute_rdp(q=0.01, noise_multiplier=1.1, steps=1000, orders=privacy_analysis.DEFAULT_ALPHAS)
    ref_eps, ref_alpha = opacus_rdp.get_privacy_spent(orders=privacy_analysis.DEFAULT_ALPHAS, rdp=ref_rdp, delta=1e-5)
    np.testing.assert_allclose(rdp, ref_rdp, rtol=1e-6)
    assert eps == pytest.approx(ref_eps, rel=1e-6) and alpha == ref_alpha


def test_default_alphas_are_opacus_orders():
    from opacus.accountants import RDPAccountant as OpacusRDP

    from opacus_dp.accountants import RDPAccountant
    from opacus_dp.privacy_analysis import DEFAULT_ALPHAS

    assert DEFAULT_ALPHAS == OpacusRDP.DEFAULT_ALPHAS == RDPAccountant.DEFAULT_ALPHAS


def test_modern_paths_exist():
    from opacus_dp.accountants import IAccountant, PrivacyAccountant
    from opacus_dp.accountants.analysis import gdp, rdp  # noqa: F401
    from opacus_dp.accountants.utils import get_noise_multiplier  # noqa: F401

    assert IAccountant is PrivacyAccountant


def test_accountants_do_not_import_reference_libraries():
    import subprocess
    import sys

    code = (
        "import sys, opacus_dp.accountants, opacus_dp.privacy_analysis, opacus_dp.cli;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('opacus', 'dp_accounting')];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, capture_output=True)
