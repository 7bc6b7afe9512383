"""Run Opacus's own public-API test suites against opacus_dp, with only the import renamed.

The tests are not part of this repository; they are obtained when the script runs:

* Opacus 1.6: ``opacus/tests/`` of the installed ``opacus`` package (the ``test`` extra);
* Opacus 0.15: ``opacus/tests/`` of the ``opacus==0.15.0`` wheel, fetched once with
  ``pip download`` into a cache directory (``--cache``, default ``.cache/opacus_suites``).

The test tree is copied to a temporary package, ``opacus`` is renamed to ``opacus_dp`` as a word
in every file (``import opacus``, ``from opacus.x import``, logger names), and pytest runs the
selected suites. ``--reference`` runs the same suites, unrenamed, against the installed Opacus
(1.6 only: Opacus 0.15 needs a PyTorch of its era; its tests are all meant to pass).

A test that fails for opacus_dp must be listed in the table "Opacus's test suites" of
docs/compatibility.md, with its category (network, private-helper, looser-number,
deliberate-difference) and reason; the exit status is 1 when one is not, 3 when a generation's
tests cannot be obtained (Opacus not installed, no network for the 0.15 download), 0 otherwise.
"""

import argparse
import fnmatch
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "compatibility.md"
DOC_SECTION = "## Opacus's test suites"
CATEGORIES = ("network", "private-helper", "looser-number", "deliberate-difference")
SUITES = {
    "0.15": ("privacy_engine_test", "virtual_step_test", "poisson_test", "dp_model_inspector_test"),
    "1.6": ("privacy_engine_test", "accountants_test", "batch_memory_manager_test",
            "dpdataloader_test", "module_validator_test", "poisson_test"),
}
WHEEL_015 = "opacus-0.15.0-py3-none-any.whl"
WORD = re.compile(r"\bopacus\b")
EXIT_UNEXPECTED, EXIT_UNAVAILABLE = 1, 3


class Unavailable(RuntimeError):
    """A generation's tests cannot be obtained here."""


@dataclass
class Exception_:
    pattern: str  # "<generation> <file>::<Class>::<test>", fnmatch wildcards allowed
    category: str
    reason: str

    def matches(self, test_id: str) -> bool:
        return fnmatch.fnmatchcase(test_id, self.pattern)


@dataclass
class Run:
    """The outcome of one generation's suites against one target (opacus_dp or opacus)."""
    target: str
    outcomes: Dict[str, str] = field(default_factory=dict)  # test id -> passed/failed/skipped
    messages: Dict[str, str] = field(default_factory=dict)  # failed test id -> first line
    seconds: Dict[str, float] = field(default_factory=dict)  # test id -> its duration
    wall_s: float = 0.0


def read_exceptions(doc: Path = DOC) -> List[Exception_]:
    """The rows of the exception table in ``doc``'s section :data:`DOC_SECTION`."""
    text = doc.read_text(encoding="utf-8")
    start = text.find(DOC_SECTION + "\n")
    if start < 0:
        raise ValueError(f"{doc}: no section {DOC_SECTION!r}")
    section = text[start + len(DOC_SECTION):]
    section = section[:section.find("\n## ")] if "\n## " in section else section
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        pattern, category, reason = cells[0].strip("`"), cells[1].strip("`"), cells[2]
        if pattern.split(" ")[0] not in SUITES or category not in CATEGORIES or not reason:
            raise ValueError(f"{doc}: bad exception row: {line.strip()}")
        rows.append(Exception_(pattern, category, reason))
    return rows


def exception_for(test_id: str, exceptions: List[Exception_]) -> Optional[Exception_]:
    return next((e for e in exceptions if e.matches(test_id)), None)


# ----------------------------------------------------------------------------- obtaining tests

def opacus_16_tests() -> Dict[str, bytes]:
    """The files of the installed Opacus's ``tests`` package, by relative path."""
    spec = importlib.util.find_spec("opacus")
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable("opacus is not installed (pip install -e .[test])")
    version = importlib.metadata.version("opacus")
    if not version.startswith("1.6"):
        raise Unavailable(f"opacus {version} is installed, the 1.6 suites need opacus 1.6")
    tests = Path(list(spec.submodule_search_locations)[0]) / "tests"
    if not tests.is_dir():
        raise Unavailable(f"{tests} is missing")
    return {p.relative_to(tests).as_posix(): p.read_bytes()
            for p in sorted(tests.rglob("*.py"))}


def opacus_015_tests(cache: Path) -> Dict[str, bytes]:
    """The files of ``opacus/tests/`` in the Opacus 0.15.0 wheel (downloaded once to ``cache``)."""
    wheel = cache / WHEEL_015
    if not wheel.exists():
        cache.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "opacus==0.15.0", "--no-deps",
                   "--only-binary=:all:", "--disable-pip-version-check", "-q", "-d", str(cache)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            raise Unavailable("pip download opacus==0.15.0 timed out (no network?)")
        if done.returncode or not wheel.exists():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise Unavailable(f"pip download opacus==0.15.0 failed (no network?): {last}")
    prefix = "opacus/tests/"
    with zipfile.ZipFile(wheel) as archive:
        return {name[len(prefix):]: archive.read(name) for name in archive.namelist()
                if name.startswith(prefix) and name.endswith(".py")}


def obtain(generation: str, cache: Path) -> Dict[str, bytes]:
    return opacus_015_tests(cache) if generation == "0.15" else opacus_16_tests()


def rename(source: str) -> str:
    """``opacus`` as a word becomes ``opacus_dp`` (imports, dotted paths, logger names)."""
    return WORD.sub("opacus_dp", source)


def materialise(files: Dict[str, bytes], where: Path, package: str, renamed: bool,
                max_examples: Optional[int] = None) -> Path:
    """Write the test tree as ``where/package/tests/`` (a package, so that the tests' relative
    imports work) with a neutral pytest configuration; return the tests directory. With
    ``max_examples``, a ``conftest.py`` of the harness caps the examples each hypothesis test
    draws (the tests themselves are unchanged; their own settings keep every other field)."""
    tests = where / package / "tests"
    for relative, content in files.items():
        target = tests / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        text = content.decode("utf-8")
        target.write_text(rename(text) if renamed else text, encoding="utf-8")
    for directory in [where / package, *(p for p in tests.rglob("*") if p.is_dir()), tests]:
        (directory / "__init__.py").touch()
    (where / "pytest.ini").write_text("[pytest]\n", encoding="utf-8")
    if max_examples:
        (where / "conftest.py").write_text(
            "from hypothesis import settings\n"
            f"settings.register_profile('harness', max_examples={int(max_examples)})\n"
            "settings.load_profile('harness')\n", encoding="utf-8")
    return tests


# ----------------------------------------------------------------------------- running pytest

def test_id(generation: str, package: str, case: ET.Element) -> str:
    """``"<generation> <file>::<Class>::<test>"`` from a JUnit ``testcase``."""
    if not case.get("classname"):  # a module that failed to import
        return f"{generation} {case.get('name', '').removeprefix(f'{package}.tests.')}.py::<collection>"
    module, _, cls = case.get("classname", "").removeprefix(f"{package}.tests.").partition(".")
    parts = [f"{module}.py"] + ([cls.replace(".", "::")] if cls else []) + [case.get("name", "")]
    return f"{generation} " + "::".join(parts)


def first_line(problem: ET.Element) -> str:
    """The line that says what went wrong: the failure's message, or a collection error's
    ``E`` line."""
    text = problem.text or ""
    if problem.get("message") and problem.get("message") != "collection failure":
        text = problem.get("message")
    lines = [line for line in text.strip().splitlines() if line.strip()]
    error_lines = [line[1:].strip() for line in lines if line.startswith("E ")]
    return (error_lines or lines or [""])[0][:300]


def parse_report(report: Path, generation: str, package: str, run: Run) -> None:
    for case in ET.parse(report).getroot().iter("testcase"):
        name = test_id(generation, package, case)
        run.seconds[name] = run.seconds.get(name, 0.0) + float(case.get("time") or 0.0)
        problem = case.find("failure")
        problem = problem if problem is not None else case.find("error")
        if problem is not None:
            run.outcomes[name] = "failed"
            run.messages[name] = first_line(problem)
        elif case.find("skipped") is not None:
            run.outcomes.setdefault(name, "skipped")
        else:
            run.outcomes.setdefault(name, "passed")


def run_suites(generation: str, files: Dict[str, bytes], suites, target: str,
               workers: int, timeout: float, max_examples: Optional[int] = None) -> Run:
    """Run ``suites`` of ``files`` against ``target`` ("opacus_dp" renames the imports)."""
    run = Run(target)
    package = f"opacus_suite_{generation.replace('.', '_')}_{target}"
    with tempfile.TemporaryDirectory(prefix="opacus_suites_") as tmp:
        where = Path(tmp)
        tests = materialise(files, where, package, renamed=target == "opacus_dp", max_examples=max_examples)
        report = where / "report.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   "-c", str(where / "pytest.ini"), "--rootdir", str(where),
                   f"--junitxml={report}", "-o", "junit_family=xunit1",
                   *(["-n", str(workers)] if workers else []),
                   *(str(tests / f"{suite}.py") for suite in suites)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
        env.setdefault("OMP_NUM_THREADS", "1")
        start = time.monotonic()
        try:
            done = subprocess.run(command, cwd=where, env=env, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{generation} suites against {target} ran past {timeout:.0f} s")
        run.wall_s = time.monotonic() - start
        if not report.exists():
            raise RuntimeError(f"pytest wrote no report (exit {done.returncode}):\n"
                               + done.stdout[-3000:] + done.stderr[-3000:])
        parse_report(report, generation, package, run)
    return run


# ----------------------------------------------------------------------------- reporting

def counts(run: Run, suite: str) -> Dict[str, float]:
    tally = {"passed": 0, "failed": 0, "skipped": 0, "seconds": 0.0}
    for name, outcome in run.outcomes.items():
        if name.split(" ", 1)[1].startswith(f"{suite}.py::"):
            tally[outcome] += 1
            tally["seconds"] += run.seconds.get(name, 0.0)
    return tally


def summary(generation: str, suites, ours: Run, reference: Optional[Run]) -> List[str]:
    lines = [f"Opacus {generation} suites (opacus_dp {ours.wall_s:.0f} s"
             + (f", opacus {reference.wall_s:.0f} s)" if reference else ")")]
    for suite in suites:
        tally = "{passed} passed, {failed} failed, {skipped} skipped ({seconds:.0f} s)"
        line = f"  {suite:28s} opacus_dp: {tally.format(**counts(ours, suite))}"
        if reference:
            line += f" | opacus: {tally.format(**counts(reference, suite))}"
        lines.append(line)
    return lines


def failures(ours: Run, reference: Optional[Run], exceptions: List[Exception_]):
    """Lines describing every opacus_dp failure, and the ids of the unexpected ones."""
    lines, unexpected = [], []
    for name in sorted(n for n, o in ours.outcomes.items() if o == "failed"):
        known = exception_for(name, exceptions)
        ref = reference.outcomes.get(name, "?") if reference else None
        tag = f"exception: {known.category}" if known else "UNEXPECTED"
        tag += f"; opacus: {ref}" if ref else ""
        lines.append(f"  [{tag}] {name}\n      {ours.messages.get(name, '')}")
        if not known:
            unexpected.append(name)
    return lines, unexpected


def stale(ours: Run, exceptions: List[Exception_], generation: str) -> List[str]:
    """Exception rows of ``generation`` that match no failing test (passing now, or renamed)."""
    failed = [n for n, o in ours.outcomes.items() if o == "failed"]
    return [e.pattern for e in exceptions if e.pattern.startswith(generation + " ")
            and not any(e.matches(n) for n in failed)]


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--generation", choices=["0.15", "1.6", "both"], default="both")
    parser.add_argument("--suite", action="append", default=None,
                        help="run only this suite (e.g. privacy_engine_test); repeatable")
    parser.add_argument("--reference", action="store_true",
                        help="also run the 1.6 suites against the installed Opacus")
    parser.add_argument("--workers", "-n", type=int, default=0,
                        help="pytest-xdist workers (0: none)")
    parser.add_argument("--cache", type=Path, default=Path(
        os.environ.get("OPACUS_SUITES_CACHE", ROOT / ".cache" / "opacus_suites")),
        help="where the Opacus 0.15 wheel is kept")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per pytest run")
    parser.add_argument("--max-examples", type=int, default=None,
                        help="cap the examples of each hypothesis test (default: the tests' own, 100)")
    parser.add_argument("--json", type=Path, default=None, help="write the outcomes here")
    return parser.parse_args(argv)


def run_generation(generation: str, args, exceptions, record: dict) -> int:
    suites = [s for s in SUITES[generation] if not args.suite or s in args.suite]
    if not suites:
        return 0
    try:
        files = obtain(generation, args.cache)
    except Unavailable as reason:
        print(f"Opacus {generation} suites: not run: {reason}")
        record[generation] = {"unavailable": str(reason)}
        return EXIT_UNAVAILABLE
    ours = run_suites(generation, files, suites, "opacus_dp", args.workers, args.timeout, args.max_examples)
    reference = None
    if args.reference and generation == "1.6":
        reference = run_suites(generation, files, suites, "opacus", args.workers, args.timeout, args.max_examples)
    elif args.reference:
        print("Opacus 0.15: no reference run (it needs a PyTorch of its era); "
              "all its tests are meant to pass")
    print("\n".join(summary(generation, suites, ours, reference)))
    lines, unexpected = failures(ours, reference, exceptions)
    print("\n".join(lines))
    if not args.suite:
        for pattern in stale(ours, exceptions, generation):
            print(f"  note: listed exception matches no failure now: {pattern}")
    record[generation] = {"opacus_dp": ours.outcomes, "messages": ours.messages,
                          "opacus": reference.outcomes if reference else None,
                          "unexpected": unexpected, "seconds": ours.seconds, "wall_s": ours.wall_s}
    return EXIT_UNEXPECTED if unexpected else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    exceptions = read_exceptions()
    generations = ["0.15", "1.6"] if args.generation == "both" else [args.generation]
    record: dict = {}
    codes = [run_generation(g, args, exceptions, record) for g in generations]
    if args.json:
        args.json.write_text(json.dumps(record, indent=1), encoding="utf-8")
    if EXIT_UNEXPECTED in codes:
        print("error: opacus_dp fails tests that docs/compatibility.md does not list")
        return EXIT_UNEXPECTED
    return EXIT_UNAVAILABLE if EXIT_UNAVAILABLE in codes else 0


if __name__ == "__main__":
    sys.exit(main())
