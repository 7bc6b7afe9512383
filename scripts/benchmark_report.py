"""The report of :mod:`benchmark`: ratios per variant (to non-private, to Opacus) and the table."""

from typing import Dict

THEIRS = ("opacus:hooks", "opacus:ghost")


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def summarise(model_name: str, timing: Dict[str, dict], memory: Dict[str, dict]) -> Dict[str, dict]:
    """Ratios to non-private and to Opacus per variant: time against Opacus hooks and
    against Opacus's fastest mode, peak memory against Opacus's leanest mode; the tensors' peak
    against non-private."""
    ms = {v: r.get("ms") for v, r in timing.items()}
    mib = {v: memory.get(v, {}).get("peak_increase_mib") for v in timing}
    tensor_mib = {v: memory.get(v, {}).get("tensor_peak_mib") for v in timing}
    theirs = [v for v in THEIRS if ms.get(v) is not None]
    best = min(theirs, key=lambda v: ms[v]) if theirs else None
    measured = [v for v in theirs if mib.get(v) is not None]
    leanest = min(measured, key=lambda v: mib[v]) if measured else None
    rows = {}
    for v in timing:
        rows[v] = {
            "ms": ms[v], "x_non_private": _ratio(ms[v], ms.get("non-private")),
            "paired_x_non_private": timing[v].get("paired_x_non_private"),
            "faults": timing[v].get("faults"),
            "speedup_vs_opacus_hooks": _ratio(ms.get("opacus:hooks"), ms[v]),
            "paired_speedup_vs_opacus_hooks": timing[v].get("paired_speedup_vs_opacus_hooks"),
            "speedup_vs_opacus_best": _ratio(ms.get(best), ms[v]) if best else None,
            "peak_mib": mib[v], "mem_x_non_private": _ratio(mib[v], mib.get("non-private")),
            "mem_x_opacus_leanest": _ratio(mib[v], mib.get(leanest)) if leanest else None,
            "tensor_peak_mib": tensor_mib[v],
            "tensor_x_non_private": _ratio(tensor_mib[v], tensor_mib.get("non-private")),
            "error": timing[v].get("error") or memory.get(v, {}).get("error"),
        }
    return rows


def _fmt(value, spec):
    width = int(spec.split(".")[0]) if spec[0].isdigit() else 0
    return "-".rjust(width) if value is None else format(value, spec)


def print_table(report: dict) -> None:
    head = (f"{'model':12s} {'variant':14s} {'step ms':>9s} {'x non-priv':>10s} {'paired x':>8s} {'faults':>7s} "
            f"{'speedup/Op.hk':>15s} {'paired':>6s} {'speedup/Op.best':>14s} {'peak MiB':>9s} "
            f"{'mem x np':>8s} {'mem x Op.min':>13s} {'tensor MiB':>10s} {'x np':>5s}")
    print(head)
    print("-" * len(head))
    for model_name, entry in report["models"].items():
        for v, r in entry["variants"].items():
            if r["error"]:
                print(f"{model_name:12s} {v:14s} n/a: {r['error']}")
                continue
            print(f"{model_name:12s} {v:14s} {_fmt(r['ms'], '9.1f')} {_fmt(r['x_non_private'], '10.2f')} "
                  f"{_fmt(r['paired_x_non_private'], '8.2f')} {_fmt(r['faults'], '7.0f')} "
                  f"{_fmt(r['speedup_vs_opacus_hooks'], '15.2f')} "
                  f"{_fmt(r['paired_speedup_vs_opacus_hooks'], '6.2f')} {_fmt(r['speedup_vs_opacus_best'], '14.2f')} "
                  f"{_fmt(r['peak_mib'], '9.1f')} {_fmt(r['mem_x_non_private'], '8.2f')} "
                  f"{_fmt(r['mem_x_opacus_leanest'], '13.2f')} {_fmt(r['tensor_peak_mib'], '10.1f')} "
                  f"{_fmt(r['tensor_x_non_private'], '5.2f')}")
        print(f"{'':12s} auto -> {entry['auto']}")


