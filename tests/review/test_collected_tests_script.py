"""``scripts/collected_tests.py``, the count behind ``scripts/test.sh``'s refusal of a run that
collects too few tests: the same count whatever verbosity flags are passed, and a failed
collection is an error rather than a count."""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "collected_tests.py")


def _count(directory, *args):
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=directory, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def suite(tmp_path):
    (tmp_path / "test_three.py").write_text(textwrap.dedent("""
        import pytest

        def test_a():
            pass

        @pytest.mark.parametrize("n", [1, 2])
        def test_b(n):
            pass
    """))
    (tmp_path / "test_one.py").write_text("def test_c():\n    pass\n")
    return tmp_path


@pytest.mark.parametrize("flags", [[], ["-q"], ["-qq"], ["-q", "-q", "-x"], ["-v"]])
def test_counts_every_collected_test_whatever_the_verbosity(suite, flags):
    result = _count(suite, *flags)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "4"


def test_counts_a_selection(suite):
    result = _count(suite, "test_three.py", "-k", "test_b")
    assert result.stdout.strip() == "2"


def test_a_collection_error_is_not_a_count(suite):
    (suite / "test_broken.py").write_text("import module_that_does_not_exist\n")
    result = _count(suite)
    assert result.returncode != 0
    assert result.stdout.strip() == ""
    assert "collection failed" in result.stderr
    assert "module_that_does_not_exist" in result.stderr  # pytest's report, for the fix


def test_no_tests_counts_zero(tmp_path):
    result = _count(tmp_path)
    assert result.returncode == 0
    assert result.stdout.strip() == "0"
