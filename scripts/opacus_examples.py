"""Run Opacus's own example scripts, unchanged, with opacus_dp standing in for ``opacus``.

The scripts are not part of this repository: they are the ``examples/`` of the Opacus 1.6.0
source distribution (the newest release whose sdist ships them), fetched once with
``pip download`` into a cache directory (``--cache``, default ``.cache/opacus_examples``) and
checked against a pinned SHA-256. Each selected run is

    python -m opacus_dp.as_opacus <script> <tiny settings>

in its own working directory, on synthetic data written in the real on-disk formats that
torchvision and the scripts read (MNIST idx files, CIFAR-10 pickles, one ``<language>.txt`` of
names per class), so that ``download=True`` finds the data present. CIFAR-10's loader also checks
the MD5 of the real files; a ``sitecustomize`` on ``PYTHONPATH`` makes that check accept the
files of a folder marked ``SYNTHETIC`` (it changes nothing else). A run passes when it exits with
status 0 and the last ``ε = x`` it printed is finite. ``--reference`` runs the same scripts with
the installed Opacus, for comparison only.

A failing run must be listed in the table "Opacus's example scripts" of docs/compatibility.md
with its category and reason; the exit status is 1 when one is not, 3 when the sdist cannot be
obtained (no network, no cached copy), 0 otherwise.
"""

import argparse
import hashlib
import importlib.metadata
import json
import math
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.examples.fake_data import write_cifar10, write_mnist, write_names  # noqa: E402

RELEASE = "1.6.0"
SDIST = f"opacus-{RELEASE}.tar.gz"
SDIST_SHA256 = "20d77252c1e8528cd5826fbaba345cd39ed5c3edb841707eafb6403fe276140a"
DOC = ROOT / "docs" / "compatibility.md"
DOC_SECTION = "## Opacus's example scripts"
CATEGORIES = ("deliberate-difference", "fails-with-opacus")
EXIT_UNEXPECTED, EXIT_UNAVAILABLE = 1, 3
EPSILON = re.compile(r"ε = ([-+]?(?:[0-9.]+(?:e[-+]?[0-9]+)?|nan|inf))")

SITE_CUSTOMIZE = '''\
"""Accept the synthetic CIFAR-10 files of a folder marked SYNTHETIC (their MD5 is not CIFAR-10's)."""
import os
import torchvision.datasets.cifar as _cifar

_check_integrity = _cifar.check_integrity


def _synthetic_or_checked(fpath, md5=None):
    if os.path.isfile(os.path.join(os.path.dirname(str(fpath)), "SYNTHETIC")):
        return os.path.isfile(fpath)
    return _check_integrity(fpath, md5)


_cifar.check_integrity = _synthetic_or_checked
'''


class Unavailable(RuntimeError):
    """The Opacus sdist cannot be obtained here."""


@dataclass(frozen=True)
class Example:
    name: str  # the run's id in reports and in docs/compatibility.md
    script: str  # a file of the sdist's examples/
    args: Tuple[str, ...]  # {device}, {data}, {names}, {out}, {digit} are filled in


_CIFAR = ("--device", "{device}", "--data-root", "{data}", "--batch-size", "8", "-b", "16",
          "--epochs", "1", "-j", "0", "--print-freq", "1")
_NAMES = ("--device", "{device}", "--data-root", "{names}", "-b", "8", "--epochs", "1",
          "--embedding-size", "8", "--hidden-size", "8")
EXAMPLES = (
    Example("mnist", "mnist.py", ("--device", "{device}", "--data-root", "{data}", "-b", "16",
                                  "--test-batch-size", "16", "-n", "1")),
    Example("cifar10", "cifar10.py", _CIFAR),
    Example("cifar10-per-layer", "cifar10.py", _CIFAR + ("--clip_per_layer",)),
    Example("cifar10-functorch", "cifar10.py", _CIFAR + ("--grad_sample_mode", "functorch")),
    Example("cifar10-no_op", "cifar10.py", _CIFAR + ("--grad_sample_mode", "no_op")),
    Example("char-lstm", "char-lstm-classification.py", _NAMES),
    Example("char-lstm-gru", "char-lstm-classification.py", _NAMES + ("--mode", "gru")),
    Example("char-lstm-rnn", "char-lstm-classification.py", _NAMES + ("--mode", "rnn")),
    Example("dcgan", "dcgan.py", ("--device", "{device}", "--data-root", "{data}", "--batch-size", "4",
                                  "--epochs", "1", "--workers", "0", "--ngf", "4", "--ndf", "4",
                                  "--nz", "8", "--outf", "{out}", "--target-digit", "{digit}",
                                  "--manualSeed", "1")),
)


@dataclass
class Outcome:
    """One run of one example against one target (``opacus_dp`` through the alias, or ``opacus``)."""
    name: str
    target: str
    returncode: Optional[int]  # None: ran past the timeout
    epsilon: Optional[float]  # the last ε printed
    epsilon_line: str
    tail: str  # the last lines of output, for a failure
    seconds: float

    @property
    def passed(self) -> bool:
        return self.returncode == 0 and self.epsilon is not None and math.isfinite(self.epsilon)


def read_known_failures(doc: Path = DOC) -> Dict[str, Tuple[str, str]]:
    """``{run name: (category, reason)}`` from the table of ``doc``'s section :data:`DOC_SECTION`."""
    text = doc.read_text(encoding="utf-8")
    start = text.find(DOC_SECTION + "\n")
    if start < 0:
        raise ValueError(f"{doc}: no section {DOC_SECTION!r}")
    section = text[start + len(DOC_SECTION):].split("\n## ")[0]
    names, rows = {e.name for e in EXAMPLES}, {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        name, category, reason = cells[0].strip("`"), cells[1].strip("`"), cells[2]
        if name not in names or category not in CATEGORIES or not reason or name in rows:
            raise ValueError(f"{doc}: bad row (unknown or repeated run, category not one of "
                             f"{', '.join(CATEGORIES)}, or no reason): {line.strip()}")
        rows[name] = (category, reason)
    return rows


# ----------------------------------------------------------------------------- obtaining the scripts

def fetch_sdist(cache: Path) -> Path:
    """The Opacus sdist in ``cache``, downloaded with pip if absent; its SHA-256 is checked."""
    sdist = cache / SDIST
    if not sdist.exists():
        cache.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", f"opacus=={RELEASE}", "--no-deps",
                   "--no-binary=:all:", "--disable-pip-version-check", "-q", "-d", str(cache)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            raise Unavailable(f"pip download opacus=={RELEASE} timed out (no network?)")
        if done.returncode or not sdist.exists():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise Unavailable(f"pip download opacus=={RELEASE} failed (no network?): {last}")
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise Unavailable(f"{sdist} has SHA-256 {digest}, expected {SDIST_SHA256}: delete it and rerun")
    return sdist


def extract_examples(sdist: Path, where: Path) -> Path:
    """Write the sdist's ``examples/*.py`` (only those) to ``where/examples``; return that folder."""
    prefix, folder = f"opacus-{RELEASE}/examples/", where / "examples"
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            name = member.name[len(prefix):]
            if member.isfile() and member.name.startswith(prefix) and "/" not in name and name.endswith(".py"):
                (folder / name).write_bytes(archive.extractfile(member).read())
    return folder


# ----------------------------------------------------------------------------- data and runs

def write_data(where: Path, device: str) -> Dict[str, str]:
    """Synthetic MNIST, CIFAR-10 and names under ``where``; the placeholders of :data:`EXAMPLES`."""
    data = where / "data"
    write_mnist(str(data), train_size=64, test_size=16)
    write_cifar10(str(data), per_batch=8, test_size=16)
    (data / "cifar-10-batches-py" / "SYNTHETIC").touch()
    names = write_names(str(where / "names"))
    labels = (data / "MNIST" / "raw" / "train-labels-idx1-ubyte").read_bytes()[8:]
    digit = Counter(labels).most_common(1)[0][0]  # dcgan trains on one digit: the most frequent
    (where / "site").mkdir()
    (where / "site" / "sitecustomize.py").write_text(SITE_CUSTOMIZE, encoding="utf-8")
    return {"device": device, "data": str(data), "names": names, "digit": str(digit)}


def last_epsilon(output: str) -> Tuple[Optional[float], str]:
    """The last ``ε = x`` printed (progress bars included) and the line it is on."""
    lines = [line for line in re.split(r"[\r\n]", output) if EPSILON.search(line)]
    if not lines:
        return None, ""
    return float(EPSILON.findall(lines[-1])[-1]), lines[-1].strip()[-200:]


def run_one(example: Example, target: str, scripts: Path, where: Path, values: Dict[str, str],
            timeout: float) -> Outcome:
    """Run ``example`` in a fresh working directory, through the alias when ``target`` is opacus_dp."""
    cwd = where / "runs" / f"{example.name}-{target}"
    cwd.mkdir(parents=True)
    args = [a.format(**values, out=str(cwd / "out")) for a in example.args]
    launcher = ["-m", "opacus_dp.as_opacus"] if target == "opacus_dp" else []
    command = [sys.executable, *launcher, str(scripts / example.script), *args]
    env = dict(os.environ, PYTHONIOENCODING="utf-8", PYTHONPATH=os.pathsep.join(
        [str(where / "site"), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    env.setdefault("OMP_NUM_THREADS", "1")
    start = time.monotonic()
    try:
        done = subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=timeout, encoding="utf-8", errors="replace")
        returncode, output = done.returncode, done.stdout
    except subprocess.TimeoutExpired as expired:
        partial = expired.stdout or b""
        returncode = None
        output = (partial.decode("utf-8", "replace") if isinstance(partial, bytes) else partial) \
            + f"\nran past {timeout:.0f} s"
    epsilon, line = last_epsilon(output)
    tail = "\n".join(output.strip().splitlines()[-6:])[-1500:]
    return Outcome(example.name, target, returncode, epsilon, line, tail, time.monotonic() - start)


def run_all(examples, targets, scripts, where, values, timeout, jobs) -> List[Outcome]:
    tasks = [(e, t) for e in examples for t in targets]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(lambda task: run_one(*task, scripts, where, values, timeout), tasks))


# ----------------------------------------------------------------------------- reporting

def report(outcomes: List[Outcome], known: Dict[str, Tuple[str, str]]) -> Tuple[List[str], List[str]]:
    """Lines for every run, and the names of the opacus_dp runs that failed without being listed."""
    lines, unexpected = [f"Opacus {RELEASE} example scripts"], []
    for o in outcomes:
        status = "timed out" if o.returncode is None else f"exit {o.returncode}"
        epsilon = "no ε printed" if o.epsilon is None else f"ε = {o.epsilon:g}"
        tag = "passed" if o.passed else "FAILED"
        if o.target == "opacus_dp" and not o.passed:
            tag = f"known: {known[o.name][0]}" if o.name in known else "UNEXPECTED"
            unexpected += [] if o.name in known else [o.name]
        lines.append(f"  {o.name:20s} {o.target:9s} {tag:32s} {status:8s} {epsilon:14s} {o.seconds:5.1f} s")
        if o.target == "opacus_dp" and not o.passed:
            lines.append("      " + o.tail.replace("\n", "\n      "))
    passing = {o.name for o in outcomes if o.target == "opacus_dp" and o.passed}
    for name in sorted(set(known) & passing):
        lines.append(f"  note: listed failure passes now: {name}")
    return lines, unexpected


def reference_available() -> Optional[str]:
    """Why the installed Opacus cannot be the reference, or None."""
    try:
        version = importlib.metadata.version("opacus")
    except importlib.metadata.PackageNotFoundError:
        return "opacus is not installed"
    return None if version.startswith("1.6") else f"opacus {version} is installed, not 1.6"


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--example", action="append", choices=[e.name for e in EXAMPLES],
                        help="run only this example (repeatable; default: all)")
    parser.add_argument("--reference", action="store_true",
                        help="also run the scripts with the installed Opacus, for comparison")
    parser.add_argument("--device", default="cpu", help="the scripts' --device (default: cpu)")
    parser.add_argument("--jobs", "-j", type=int, default=1, help="runs at the same time")
    parser.add_argument("--cache", type=Path, default=Path(
        os.environ.get("OPACUS_EXAMPLES_CACHE", ROOT / ".cache" / "opacus_examples")),
        help="where the Opacus sdist is kept")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run")
    parser.add_argument("--json", type=Path, default=None, help="write the outcomes here")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    known = read_known_failures()
    try:
        sdist = fetch_sdist(args.cache)
    except Unavailable as reason:
        print(f"Opacus {RELEASE} example scripts: not run: {reason}")
        return EXIT_UNAVAILABLE
    targets = ["opacus_dp"]
    why_not = reference_available() if args.reference else None
    if args.reference and why_not:
        print(f"no reference run: {why_not}")
    elif args.reference:
        targets.append("opacus")
    examples = [e for e in EXAMPLES if not args.example or e.name in args.example]
    with tempfile.TemporaryDirectory(prefix="opacus_examples_") as tmp:
        where = Path(tmp)
        scripts = extract_examples(sdist, where)
        outcomes = run_all(examples, targets, scripts, where, write_data(where, args.device),
                           args.timeout, args.jobs)
    lines, unexpected = report(outcomes, known)
    print("\n".join(lines))
    if args.json:
        record = {"release": RELEASE, "outcomes": [asdict(o) | {"passed": o.passed} for o in outcomes],
                  "unexpected": unexpected}
        args.json.write_text(json.dumps(record, indent=1, ensure_ascii=False), encoding="utf-8")
    if unexpected:
        print("error: Opacus example runs fail for opacus_dp that docs/compatibility.md does not list: "
              + ", ".join(unexpected))
        return EXIT_UNEXPECTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
