"""``install_as_opacus()``: a library that imports ``opacus`` at module level runs on opacus_dp.

Oracle: the same library text written against ``opacus_dp`` directly, trained from the same seed,
must give bitwise the same parameters and ε. Every test restores ``sys.meta_path`` and
``sys.modules`` (a real ``opacus`` imported by another test in this worker is put back).
"""

import importlib
import subprocess
import sys
import textwrap

import pytest
import torch

import opacus_dp
from opacus_dp.integrations import (OpacusAlreadyImportedError, install_as_opacus, opacus_alias,
                                    uninstall_as_opacus)
from opacus_dp.integrations.opacus_paths import ABSENT, OPACUS_PATHS

# the engines these tests build never take a step that needs secure noise
pytestmark = [pytest.mark.filterwarnings("ignore::opacus_dp.engine.private_step.SecureModeNotice"),
              pytest.mark.filterwarnings("ignore:Secure RNG turned off")]


def _opacus_entries():
    return {name: mod for name, mod in sys.modules.items() if name == "opacus" or name.startswith("opacus.")}


@pytest.fixture
def clean_opacus():
    """No ``opacus`` module while the test runs; the worker's previous ones are put back after."""
    saved_meta_path = list(sys.meta_path)
    saved = _opacus_entries()
    for name in saved:
        del sys.modules[name]
    yield
    uninstall_as_opacus()
    for name in _opacus_entries():
        del sys.modules[name]
    sys.modules.update(saved)
    sys.meta_path[:] = saved_meta_path


LIBRARY = '''
import torch
from torch.utils.data import DataLoader, TensorDataset
import {pkg}
from {pkg} import PrivacyEngine
from {pkg}.accountants import RDPAccountant
from {pkg}.grad_sample import GradSampleModule
from {pkg}.optimizers import DPOptimizer
from {pkg}.utils.batch_memory_manager import BatchMemoryManager
from {pkg}.validators import ModuleValidator


def _model():
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                               torch.nn.Linear(8, 3))


def train_make_private(seed):
    torch.manual_seed(seed)
    data = TensorDataset(torch.randn(64, 5), torch.randint(0, 3, (64,)))
    model = ModuleValidator.fix(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(data, batch_size=16),
        noise_multiplier=1.1, max_grad_norm=0.7)
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=4, optimizer=optimizer) as batches:
        for x, y in batches:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    return [p.detach().clone() for p in model.parameters()], engine.get_epsilon(1e-5)


def train_parts(seed):
    torch.manual_seed(seed)
    x, y = torch.randn(12, 5), torch.randint(0, 3, (12,))
    model = GradSampleModule(torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)))
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), noise_multiplier=0.8,
                            max_grad_norm=0.5, expected_batch_size=12)
    accountant = RDPAccountant()
    for _ in range(3):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        accountant.step(noise_multiplier=0.8, sample_rate=0.25)
    return [p.detach().clone() for p in model.parameters()], accountant.get_epsilon(1e-5)
'''


def _write_library(tmp_path, name, pkg):
    package = tmp_path / name
    package.mkdir()
    (package / "__init__.py").write_text(LIBRARY.format(pkg=pkg))


def test_library_importing_opacus_trains_bitwise_as_opacus_dp(clean_opacus, tmp_path, monkeypatch):
    _write_library(tmp_path, "lib_on_opacus", "opacus")
    _write_library(tmp_path, "lib_on_opacus_dp", "opacus_dp")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        install_as_opacus()
        aliased = importlib.import_module("lib_on_opacus")
        direct = importlib.import_module("lib_on_opacus_dp")
        assert aliased.PrivacyEngine is opacus_dp.PrivacyEngine
        assert aliased.opacus is opacus_dp
        for train in ("train_make_private", "train_parts"):
            got_params, got_eps = getattr(aliased, train)(3)
            want_params, want_eps = getattr(direct, train)(3)
            assert got_eps == want_eps > 0
            assert len(got_params) == len(want_params)
            for got, want in zip(got_params, want_params):
                assert torch.equal(got, want), train
    finally:
        sys.modules.pop("lib_on_opacus", None)
        sys.modules.pop("lib_on_opacus_dp", None)


def test_module_objects_are_aliased_not_copied(clean_opacus):
    with opacus_alias():
        import opacus.privacy_engine
        import opacus.grad_sample.utils

        assert opacus.privacy_engine.PrivacyEngine is opacus_dp.PrivacyEngine
        assert sys.modules["opacus.privacy_engine"] is sys.modules["opacus_dp.privacy_engine"]
        assert opacus.grad_sample.utils is importlib.import_module("opacus_dp.grad_sample.utils")
        assert opacus_dp.privacy_engine.__spec__.name == "opacus_dp.privacy_engine"
    assert not _opacus_entries()
    assert not any(type(f).__name__ == "OpacusAliasFinder" for f in sys.meta_path)
    assert not hasattr(opacus_dp, "tests")


@pytest.mark.parametrize("path", sorted(OPACUS_PATHS))
def test_every_opacus_path_in_the_table_imports_or_names_the_guide(clean_opacus, path):
    with opacus_alias():
        if OPACUS_PATHS[path] is None:
            with pytest.raises(ModuleNotFoundError) as info:
                importlib.import_module(path)
            # the first path without counterpart is named: the path itself or its absent parent
            missing = info.value.name
            assert path == missing or path.startswith(missing + ".")
            assert repr(missing) in str(info.value) and "docs/migration.md" in str(info.value)
            assert ABSENT[missing] in str(info.value)
        else:
            module = importlib.import_module(path)
            assert module is importlib.import_module(OPACUS_PATHS[path])


def test_table_covers_every_module_of_the_installed_opacus(clean_opacus):
    """The table lists every module of Opacus 1.6, walked from the reference install."""
    import pkgutil

    real = pytest.importorskip("opacus")
    assert real.__version__.startswith("1.6")
    names = {"opacus"} | {m.name for m in pkgutil.walk_packages(real.__path__, "opacus.")}
    assert names - set(OPACUS_PATHS) == set()


def test_unknown_path_and_missing_name_raise_import_errors(clean_opacus):
    with opacus_alias():
        with pytest.raises(ModuleNotFoundError, match=r"opacus\.no_such_module.*docs/migration\.md"):
            importlib.import_module("opacus.no_such_module")
        with pytest.raises(ImportError, match="GradSampleHooks"):
            from opacus.grad_sample import GradSampleHooks  # noqa: F401
        with pytest.raises(ImportError, match="no_such_name"):
            from opacus.privacy_engine import no_such_name  # noqa: F401


def test_refuses_when_the_real_opacus_is_already_imported(clean_opacus):
    pytest.importorskip("opacus")  # the real one (clean_opacus removed any alias)
    real = sys.modules["opacus"]
    meta_path = list(sys.meta_path)
    with pytest.raises(OpacusAlreadyImportedError, match=r"install_as_opacus\(\).*before"):
        install_as_opacus()
    assert sys.meta_path == meta_path and sys.modules["opacus"] is real


def test_install_is_idempotent_and_explicit(clean_opacus):
    assert not any(type(f).__name__ == "OpacusAliasFinder" for f in sys.meta_path)  # nothing implicit
    install_as_opacus()
    opacus_dp.install_as_opacus()  # the top-level export
    assert sum(type(f).__name__ == "OpacusAliasFinder" for f in sys.meta_path) == 1
    assert type(sys.meta_path[0]).__name__ == "OpacusAliasFinder"
    import opacus

    assert opacus is opacus_dp
    assert opacus.__version__ == opacus_dp.__version__  # documented (migration.md, section 5)
    uninstall_as_opacus()
    assert "opacus" not in sys.modules


def test_test_helpers_at_opacus_paths(clean_opacus):
    with opacus_alias():
        from opacus.tests.grad_samples.common import GradSampleHooks_test, expander, shrinker

        from opacus_dp.testing.grad_samples import common

        assert GradSampleHooks_test is common.GradSampleHooks_test
        assert (expander(3), shrinker(3), shrinker(1)) == (6, 1, 1)


def test_launcher_runs_a_script_with_its_arguments(tmp_path):
    script = tmp_path / "train.py"
    (tmp_path / "sibling.py").write_text("VALUE = 7\n")
    script.write_text(textwrap.dedent("""
        import sys
        import opacus
        from opacus.accountants import RDPAccountant
        import sibling
        print(__name__, opacus.__name__, RDPAccountant.__module__, sys.argv[1:], sibling.VALUE)
    """))
    out = subprocess.run([sys.executable, "-m", "opacus_dp.as_opacus", str(script), "--x", "1"],
                         capture_output=True, text=True, timeout=120, cwd=str(tmp_path.parent))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["__main__", "opacus_dp", "opacus_dp.accountants.rdp", "['--x',", "'1']", "7"]


def test_launcher_without_a_script_names_the_usage():
    out = subprocess.run([sys.executable, "-m", "opacus_dp.as_opacus"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "python -m opacus_dp.as_opacus script.py" in out.stderr


def test_launcher_runs_a_module(tmp_path):
    package = tmp_path / "trainpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "main.py").write_text(textwrap.dedent("""
        import sys
        from opacus.optimizers import DPOptimizer
        print(__name__, DPOptimizer.__module__, sys.argv[1:])
    """))
    out = subprocess.run([sys.executable, "-m", "opacus_dp.as_opacus", "-m", "trainpkg.main", "a"],
                         capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["__main__", "opacus_dp.optim.dp_optimizer", "['a']"]
