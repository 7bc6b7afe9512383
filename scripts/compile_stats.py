"""Statistics of the compiled variants of ``scripts/benchmark.py --compile BACKEND``.

* **Graphs and graph breaks**: Dynamo's global counters, cleared on entry to :func:`counting`
  and read on exit: ``graphs`` = ``counters["stats"]["unique_graphs"]`` (FX graphs Dynamo
  captured: one per frame section it compiled, recompilations included) and ``graph_breaks`` =
  the sum of ``counters["graph_break"]`` (each place where tracing stopped and the frame was split,
  e.g. on ``print`` or a Python branch on ``Tensor.item()``). A function with no break compiles into
  one graph; ``k`` breaks in straight-line code give ``k + 1`` graphs. Only what Dynamo traces is
  counted: the forward of the compiled model (AOTAutograd derives each graph's backward from it,
  not counted separately), not the eager loss or optimizer step. Breaks are counted where Dynamo
  records them; code it skips as a whole (a ``torch.compiler.disable``d hook called between two
  layers) may split the graphs without adding to ``graph_breaks``.
* **Ratios**: for each compiled variant ``name@backend``, the medians over rounds of its time
  divided by ``name``'s eager time (``paired_x_eager``) and by ``non-private@backend``'s time
  (``paired_x_compiled_non_private``).
"""

import contextlib
import re
import statistics
from typing import Callable, Dict, Iterator

import torch

COMPILED = "@"  # "bk@inductor": variant "bk" with its model compiled by that backend
MIN_RECOMPILE_LIMIT = 64  # one frame compiled per variant and model: Dynamo's default limit is 8


def _counters():
    from torch._dynamo.utils import counters

    return counters


def _reason(text: str) -> str:
    """A break reason in one line: its ``Explanation:`` line if it has one (it names the
    function), else its first line; object addresses dropped."""
    lines = text.splitlines() or [""]
    line = next((l.strip() for l in lines if l.strip().startswith("Explanation:")), lines[0])
    return re.sub(r" at 0x[0-9a-fA-F]+", "", line)[:160]


@contextlib.contextmanager
def counting() -> Iterator[Dict[str, object]]:
    """Clear Dynamo's counters; on exit fill the yielded dict with ``graphs``, ``graph_breaks``
    and up to three ``break_reasons`` (module doc)."""
    counters = _counters()
    counters.clear()
    stats: Dict[str, object] = {}
    try:
        yield stats
    finally:
        breaks = counters["graph_break"]
        stats.update(graphs=int(counters["stats"]["unique_graphs"]),
                     graph_breaks=int(sum(breaks.values())),
                     break_reasons=[_reason(reason) for reason in list(breaks)[:3]])


def graph_stats(fn: Callable, *args, backend: str = "eager") -> Dict[str, object]:
    """:func:`counting` around one call of ``torch.compile(fn, backend=backend)(*args)``,
    on fresh Dynamo caches."""
    torch._dynamo.reset()
    with counting() as stats:
        torch.compile(fn, backend=backend)(*args)
    return stats


def allow_recompiles() -> None:
    """Raise Dynamo's per-frame recompile limit so that every compiled variant of a model (each
    a new module instance behind the same code) is compiled rather than silently run eagerly."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), MIN_RECOMPILE_LIMIT))


def add_compile_ratios(timing: Dict[str, dict]) -> None:
    """``paired_x_eager`` and ``paired_x_compiled_non_private`` of each compiled variant (module doc)."""
    for v, r in timing.items():
        if COMPILED not in v or not r.get("samples_ms"):
            continue
        name, backend = v.split(COMPILED)
        for key, base in (("paired_x_eager", name), ("paired_x_compiled_non_private",
                                                      f"non-private{COMPILED}{backend}")):
            base_samples = timing.get(base, {}).get("samples_ms")
            if base_samples:
                r[key] = statistics.median(a / b for a, b in zip(r["samples_ms"], base_samples))


def _cell(value, spec: str) -> str:
    width = int(spec.split(".")[0].rstrip("df"))
    return "-".rjust(width) if value is None else format(value, spec)


def print_compile_ratios(report: dict) -> None:
    """The ``--compile`` rows: compiled ÷ eager, compiled private ÷ compiled non-private, and the
    graphs and graph breaks Dynamo counted in two steps of the variant on fresh caches."""
    print(f"\n{'model':12s} {'compiled':22s} {'step ms':>9s} {'x eager':>8s} {'x compiled non-priv':>20s} "
          f"{'graphs':>7s} {'breaks':>7s}")
    for model_name, entry in report["models"].items():
        for v, r in entry["raw_timing"].items():
            if COMPILED not in v:
                continue
            if "error" in r:
                print(f"{model_name:12s} {v:22s} n/a: {r['error']}")
                continue
            graphs = r.get("graphs", {})
            print(f"{model_name:12s} {v:22s} {r['ms']:9.1f} {_cell(r.get('paired_x_eager'), '8.2f')} "
                  f"{_cell(r.get('paired_x_compiled_non_private'), '20.2f')} "
                  f"{_cell(graphs.get('graphs'), '7d')} {_cell(graphs.get('graph_breaks'), '7d')}")
            for reason in graphs.get("break_reasons", []):
                print(f"{'':12s}   break: {reason}")
