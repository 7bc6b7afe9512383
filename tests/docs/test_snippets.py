"""Every code block of the user documentation runs.

* ```python blocks of README.md and docs/*.md are executed, each in a fresh namespace (a block
  preceded by ``<!-- snippet: continues -->`` runs in the namespace of the block before it);
  ``<!-- snippet: skip (reason) -->`` skips one, and a skip without a reason fails.
* ```bash blocks (also in examples/README.md): every repository path they name exists, every
  ``--flag`` given to a Python script appears in that script's ``--help``, and the
  ``opacus-dp-calculator`` / ``python -m opacus_dp.cli`` / ``python -m opacus_dp.audit`` lines
  run and exit with status 0.
* ```text blocks (outputs, tables) are not run; a block without a language fails.
* Relative links resolve, README.md stays within 200 lines, and no commit hash appears.
"""

import os
import re
import shlex
import subprocess
import sys
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import List, Optional

import pytest
import torch

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
SNIPPET_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND_DOCS = [*SNIPPET_DOCS, ROOT / "examples" / "README.md"]
LANGUAGES = {"python", "bash", "text"}
README_MAX_LINES = 200

pytestmark = [
    pytest.mark.filterwarnings("ignore:secure_mode"),  # the snippets train without it
    # the classic-API snippets show Opacus 0.x loops over fixed-size batches, which the engine warns
    # about as it should (tests/compat and tests/engine check that warning)
    pytest.mark.filterwarnings("ignore::opacus_dp.data.SamplingWarning"),
    # docs/lightning.md resumes from the first run's checkpoint in a Trainer without checkpointing,
    # so Lightning points out that its ModelCheckpoint callback is not given again
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`, callbacks used to create"),
]

FENCE = re.compile(r"^\s*```(.*)$")
DIRECTIVE = re.compile(r"^\s*<!--\s*snippet:\s*(.*?)\s*-->\s*$")
SKIP = re.compile(r"^skip\s*\((.+)\)$")
REPO_PATH = re.compile(r"^(?:\./)?((?:scripts|examples|tests|docs|opacus_dp)/[\w./-]*)$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
COMMIT_HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the first line of code
    language: str
    code: str
    directive: Optional[str]

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def parse(path: Path):
    """The fenced blocks of ``path`` and the directives that precede no block."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, orphans, directive = [], [], None
    i = 0
    while i < len(lines):
        text = lines[i]
        if DIRECTIVE.match(text):
            if directive is not None:
                orphans.append((i, directive))
            directive = DIRECTIVE.match(text).group(1)
        elif FENCE.match(text):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```")), None)
            if end is None:
                raise AssertionError(f"{path}:{i + 1}: unterminated code block")
            blocks.append(Block(path, i + 2, FENCE.match(text).group(1).strip(),
                                "\n".join(lines[i + 1:end]), directive))
            directive, i = None, end
        elif text.strip() and directive is not None:
            orphans.append((i, directive))
            directive = None
        i += 1
    if directive is not None:
        orphans.append((len(lines), directive))
    return blocks, orphans


def all_blocks(paths) -> List[Block]:
    return [block for path in paths for block in parse(path)[0]]


def python_chains() -> List[List[Block]]:
    """Python blocks, each with the blocks that continue it."""
    chains = []
    for path in SNIPPET_DOCS:
        for block in parse(path)[0]:
            if block.language != "python":
                continue
            if block.directive == "continues":
                assert chains and chains[-1][0].path == path, f"{block.name}: nothing to continue"
                chains[-1].append(block)
            else:
                chains.append([block])
    return chains


CHAINS = python_chains()


# ---------------------------------------------------------------------------- structure
@pytest.mark.parametrize("path", COMMAND_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_blocks_are_tagged_and_directives_are_valid(path):
    blocks, orphans = parse(path)
    assert not orphans, f"{path.name}: snippet directives not right before a code block: {orphans}"
    for block in blocks:
        assert block.language in LANGUAGES, f"{block.name}: code block language {block.language!r} " \
                                            f"(use one of {sorted(LANGUAGES)})"
        directive = block.directive
        if directive is None:
            continue
        assert directive == "continues" or SKIP.match(directive), \
            f"{block.name}: unknown directive {directive!r}; skips need a reason: 'skip (why)'"
        assert block.language == "python", f"{block.name}: directives apply to python blocks"


def test_documentation_has_snippets():
    assert len(CHAINS) >= 20, "the python blocks were not found (parser broken?)"
    assert sum(b.language == "bash" for b in all_blocks(SNIPPET_DOCS)) >= 8


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move details to docs/"


@pytest.mark.parametrize("path", COMMAND_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(path):
    text = path.read_text(encoding="utf-8")
    missing = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        resolved = (path.parent / target.split("#")[0]).resolve()
        if not resolved.exists():
            missing.append(target)
    assert not missing, f"{path.name}: broken links {missing}"


@pytest.mark.parametrize("path", SNIPPET_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_commit_hashes(path):
    found = COMMIT_HASH.findall(path.read_text(encoding="utf-8"))
    assert not found, f"{path.name}: commit hashes {found} (history belongs in CHANGELOG.md)"


# ---------------------------------------------------------------------------- python blocks
@pytest.fixture
def snippet_sandbox(tmp_path, monkeypatch):
    """A scratch working directory, a single-process torchrun environment, torch's global
    settings restored afterwards."""
    monkeypatch.chdir(tmp_path)
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
                       "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    precision = torch.get_float32_matmul_precision()
    dtype = torch.get_default_dtype()
    try:
        with warnings.catch_warnings():
            yield tmp_path
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.set_default_dtype(dtype)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


@pytest.mark.parametrize("chain", CHAINS, ids=[chain[0].name for chain in CHAINS])
def test_python_snippet_runs(chain, snippet_sandbox):
    skip = SKIP.match(chain[0].directive or "")
    if skip:
        pytest.skip(skip.group(1))
    namespace = {"__name__": "__main__"}
    for block in chain:
        # Pad so that a traceback names the line of the document.
        source = "\n" * (block.line - 1) + block.code
        exec(compile(source, str(block.path), "exec"), namespace)  # noqa: S102


# ---------------------------------------------------------------------------- bash blocks
def command_lines(block: Block) -> List[List[str]]:
    """The block's commands as token lists (comments dropped, continuations joined)."""
    joined = block.code.replace("\\\n", " ")
    commands = []
    for line in joined.splitlines():
        tokens = shlex.split(line, comments=True)
        while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):  # VAR=value prefixes
            tokens = tokens[1:]
        if tokens:
            commands.append(tokens)
    return commands


BASH_COMMANDS = [(block, tokens) for block in all_blocks(COMMAND_DOCS) if block.language == "bash"
                 for tokens in command_lines(block)]


def _python() -> str:
    return sys.executable


@lru_cache(maxsize=None)
def script_help(script: str) -> str:
    result = subprocess.run([_python(), script, "--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, f"{script} --help failed:\n{result.stderr}"
    return result.stdout


def _python_script(tokens: List[str]) -> Optional[int]:
    """Index of the script run by ``python X.py ...`` or ``torchrun [opts] X.py ...``."""
    if tokens[0] in ("python", "python3") or tokens[0].endswith("/python") or tokens[0] == "torchrun":
        for index, token in enumerate(tokens[1:], start=1):
            if token == "-m":
                return None
            if token.endswith(".py"):
                return index
    return None


def _runnable(tokens: List[str]) -> Optional[List[str]]:
    """The command line to run for a calculator or audit command, else None."""
    entry_point = Path(_python()).parent / "opacus-dp-calculator"
    if tokens[0] == "opacus-dp-calculator":
        head = [str(entry_point)] if entry_point.exists() else [_python(), "-m", "opacus_dp.cli"]
        return head + tokens[1:]
    if tokens[0] in ("python", "python3") and tokens[1:2] == ["-m"] and \
            tokens[2] in ("opacus_dp.cli", "opacus_dp.audit"):
        return [_python(), *tokens[1:]]
    return None


@pytest.mark.parametrize("block, tokens", BASH_COMMANDS,
                         ids=[f"{block.name}:{' '.join(tokens)[:60]}" for block, tokens in BASH_COMMANDS])
def test_bash_command(block, tokens):
    for token in tokens:
        match = REPO_PATH.match(token)
        if match:
            assert (ROOT / match.group(1)).exists(), f"{block.name}: {token} does not exist"
    if tokens[0] == "bash":
        assert (ROOT / tokens[1]).is_file(), f"{block.name}: {tokens[1]} does not exist"
    script = _python_script(tokens)
    if script is not None:
        assert (ROOT / tokens[script]).is_file(), f"{block.name}: {tokens[script]} does not exist"
        flags = [flag.split("=")[0] for flag in tokens[script + 1:] if flag.startswith("--")]
        usage = script_help(tokens[script]) if flags else ""
        for name in flags:
            assert re.search(re.escape(name) + r"(?![\w-])", usage), \
                f"{block.name}: {tokens[script]} has no option {name}"
    command = _runnable(tokens)
    if command is not None:
        returncode, stdout, stderr = run_command(tuple(command))
        assert returncode == 0, f"{block.name}: {' '.join(tokens)} failed:\n{stdout}\n{stderr}"
        assert stdout.strip(), f"{block.name}: {' '.join(tokens)} printed nothing"


@lru_cache(maxsize=None)
def run_command(command: tuple):
    """``(returncode, stdout, stderr)``; a command shown in several documents runs once."""
    result = subprocess.run(list(command), cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    return result.returncode, result.stdout, result.stderr
