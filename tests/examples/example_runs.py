"""Running the example scripts from tests, and independent checks of the ε they report.

* :func:`run_example` calls a script's ``main(argv)`` in this process (argument parsing to
  files on disk, exactly as on the command line, without paying for a new interpreter);
* :func:`run_torchrun` starts a script under ``python -m torch.distributed.run`` with 2
  gloo processes on a free port; :func:`run_in_processes` starts 2 processes itself, with
  the environment torchrun would give them, each running several examples in sequence
  (one interpreter start-up for all of them);
* :func:`recomputed_epsilon` replays the saved privacy history into a fresh opacus_dp
  accountant; :func:`reference_epsilon` does the same with the reference library (Opacus).
"""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import torch

from tests.conftest import free_port

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EPSILON_LINE = re.compile(r"ε = ([0-9.]+) at δ = ([0-9.e+-]+) \((\w+) accountant\)")
SECURE_MODE_WARNING = "ignore:secure_mode is off"
_LOADED = {}


def example_module(name: str):
    """The example script ``examples/<name>.py`` imported as a module (once)."""
    if name not in _LOADED:
        if str(EXAMPLES) not in sys.path:
            sys.path.insert(0, str(EXAMPLES))
        spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _LOADED[name] = module
    return _LOADED[name]


def run_example(name: str, argv, capsys) -> str:
    """Run ``examples/<name>.py argv`` in-process; return what it printed (exit code 0 asserted).

    The tiny models run on one intra-op thread (more threads only spin on a shared machine).
    """
    module = example_module(name)
    capsys.readouterr()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = module.main([str(a) for a in argv])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert code in (0, None), out
    return out


def run_torchrun(name: str, argv, *, nproc: int = 2, timeout: float = 240) -> str:
    """Run ``examples/<name>.py`` under torchrun with ``nproc`` CPU processes; return stdout."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}",
               str(EXAMPLES / f"{name}.py"), *[str(a) for a in argv]]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=str(EXAMPLES.parent))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def run_in_processes(runs, log_dir, *, nproc: int = 2, timeout: float = 300) -> dict:
    """Run the examples ``runs = [(name, argv), ...]`` one after another in each of ``nproc``
    gloo processes started with the environment torchrun gives its workers (RANK, LOCAL_RANK,
    WORLD_SIZE, MASTER_ADDR/PORT); return ``{name: rank 0's output}``."""
    plan = {"examples": str(EXAMPLES), "runs": []}
    for name, argv in runs:
        plan["runs"].append({"name": name, "argv": [str(a) for a in argv], "port": free_port(),
                             "log": os.path.join(str(log_dir), f"{name}.rank%d.log")})
    workers = []
    for rank in range(nproc):
        rank_plan = dict(plan, runs=[dict(r, log=r["log"] % rank) for r in plan["runs"]])
        env = dict(os.environ, OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1")
        workers.append(subprocess.Popen([sys.executable, str(Path(__file__).with_name("process_worker.py")),
                                         json.dumps(rank_plan)], env=env, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outputs = []
    try:
        for worker in workers:
            outputs.append(worker.communicate(timeout=timeout))
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    for rank, (worker, (out, err)) in enumerate(zip(workers, outputs)):
        assert worker.returncode == 0, \
            f"rank {rank} exit code {worker.returncode}:\n{out[-3000:]}{err[-3000:]}"
    return {r["name"]: Path(r["log"] % 0).read_text(encoding="utf-8") for r in plan["runs"]}


def printed_epsilon(output: str) -> float:
    """The ε of the (last) ``ε = … at δ = …`` line."""
    found = EPSILON_LINE.findall(output)
    assert found, f"no epsilon line in output:\n{output}"
    return float(found[-1][0])


def read_json(path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _replayed(accountant, history):
    for sigma, q, steps in history:
        for _ in range(int(steps)):
            accountant.step(noise_multiplier=sigma, sample_rate=q)
    return accountant


def recomputed_epsilon(privacy: dict) -> float:
    """ε of the saved history according to a fresh opacus_dp accountant of the same kind."""
    from opacus_dp.accountants import create_accountant

    accountant = _replayed(create_accountant(privacy["accountant"]), privacy["history"])
    if privacy.get("alphas"):
        return float(accountant.get_privacy_spent(delta=privacy["delta"], alphas=privacy["alphas"])[0])
    return float(accountant.get_epsilon(privacy["delta"]))


def reference_epsilon(privacy: dict) -> float:
    """ε of the saved history according to the reference library (Opacus 1.6)."""
    from opacus.accountants import create_accountant

    accountant = create_accountant(privacy["accountant"])
    accountant.history = [(float(s), float(q), int(n)) for s, q, n in privacy["history"]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # log(0) inside Opacus' PRV at large q
        if privacy["accountant"] == "rdp":
            alphas = privacy.get("alphas") or accountant.DEFAULT_ALPHAS
            return float(accountant.get_privacy_spent(delta=privacy["delta"], alphas=alphas)[0])
        return float(accountant.get_epsilon(privacy["delta"]))


def assert_epsilon_consistent(output: str, privacy: dict, *, reference_rtol: float = 0.02) -> float:
    """Printed ε == our accountant's replay of the history ≈ the reference library's."""
    shown = printed_epsilon(output)
    ours = recomputed_epsilon(privacy)
    assert math.isclose(shown, ours, rel_tol=0, abs_tol=5e-6), (shown, ours)
    reference = reference_epsilon(privacy)
    assert math.isclose(ours, reference, rel_tol=reference_rtol), (ours, reference)
    return shown


def assert_history(privacy: dict, *, sigma: float, sample_rate: float, steps: int) -> None:
    """The saved history is ``steps`` steps of exactly (σ, q)."""
    for record in privacy["history"]:
        assert math.isclose(record[0], sigma, rel_tol=1e-12), privacy["history"]
        assert math.isclose(record[1], sample_rate, rel_tol=1e-12), privacy["history"]
    assert sum(int(r[2]) for r in privacy["history"]) == steps, privacy["history"]


def load_checkpoint(path) -> dict:
    assert os.path.isfile(path), f"missing checkpoint {path}"
    return torch.load(path, map_location="cpu", weights_only=False)
