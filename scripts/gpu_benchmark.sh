#!/usr/bin/env bash
# One command for the side-by-side comparison of DP-SGD against non-private training on a CUDA
# machine, written as ONE markdown table (default benchmark_gpu.md) headed by the device name:
#
#   1. scripts/benchmark.py on convnet, sequence and llama in fp32: step time and peak memory of
#      non-private, opacus_dp's hooks/ghost/bk and, when opacus is installed, Opacus 1.6's
#      hooks/ghost (a variant Opacus cannot run is a row "unsupported: <error>");
#   2. the same models under bfloat16 autocast (time only);
#   3. the compile comparison (scripts/benchmark.py --compile inductor on convnet): compiled
#      variants against their eager selves and against compiled non-private, with the graphs and
#      graph breaks Dynamo counts (scripts/compile_stats.py); the same with the model in DDP in a
#      process group of one process (--ddp);
#   4. scripts/benchmark_distributed.py --fsdp on one GPU (W = 1): the 16.8 M-parameter residual
#      MLP (8 blocks of width 1024, Adam, B = 32) under FSDP2 and DDP.
#
# Ratios "x non-private" are medians over rounds of the variant's time over the non-private time
# of the same round (compiled rows: over compiled non-private; FSDP rows: over fsdp or ddp).
#
# Usage: scripts/gpu_benchmark.sh [OUT.md] [--out OUT.md] [--device cuda|cpu] [--compile-backend B]
#   --device cpu runs the same pipeline on CPU with tiny batches and one timed round, without the
#   memory subprocesses, compiling with aot_eager unless --compile-backend says otherwise (a
#   check of the pipeline, not a measurement). Python: ${PYTHON:-.venv/bin/python}, run from the
#   repository root. The FSDP benchmark has no bf16 option: its rows are fp32.
set -euo pipefail

OUT=benchmark_gpu.md
DEVICE=cuda
BACKEND=
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --device) DEVICE=$2; shift 2 ;;
    --compile-backend) BACKEND=$2; shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ {print} /^set -euo/ {exit}' "$0"; exit 0 ;;
    -*) echo "unknown option $1" >&2; exit 2 ;;
    *) OUT=$1; shift ;;
  esac
done
case "$DEVICE" in cuda|cpu) ;; *) echo "--device must be cuda or cpu" >&2; exit 2 ;; esac
case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
START=$(date +%s)

if [ "$DEVICE" = cuda ]; then
  "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: use --device cpu')"
  SIZES=(--repeats 20 --warmup 5)
  BACKEND=${BACKEND:-inductor}
  FSDP_SIZES=(--width 1024 --layers 8 --batch-size 32 --steps 20 --warmup 5)
else
  SIZES=(--repeats 1 --warmup 0 --batch-size 2 --no-memory --threads 1 --timer cpu)
  BACKEND=${BACKEND:-aot_eager}
  FSDP_SIZES=(--width 64 --layers 2 --batch-size 4 --steps 2 --warmup 1)
fi
OPACUS=()
"$PYTHON" -c "import opacus" 2>/dev/null || OPACUS=(--no-opacus)
MODELS=convnet,sequence,llama
run() {  # run NAME ARGS...: scripts/benchmark.py with the common settings, its log kept
  local name=$1; shift
  echo "== $name: scripts/benchmark.py $*" >&2
  "$PYTHON" scripts/benchmark.py --device "$DEVICE" "${SIZES[@]}" --json "$WORK/$name.json" "$@" \
    > "$WORK/$name.log" 2>&1 || { tail -20 "$WORK/$name.log" >&2; exit 1; }
}

run fp32 --models "$MODELS" "${OPACUS[@]}"
run bf16 --models "$MODELS" "${OPACUS[@]}" --precision bf16 --no-memory
run compile --models convnet --no-opacus --no-memory --compile "$BACKEND"
run compile_ddp --models convnet --no-opacus --no-memory --compile "$BACKEND" --ddp
echo "== fsdp: scripts/benchmark_distributed.py --fsdp --world-sizes 1 ${FSDP_SIZES[*]}" >&2
"$PYTHON" scripts/benchmark_distributed.py --fsdp --device "$DEVICE" --world-sizes 1 "${FSDP_SIZES[@]}" \
  > "$WORK/fsdp.log" 2>&1 || { tail -20 "$WORK/fsdp.log" >&2; exit 1; }

"$PYTHON" - "$OUT" "$WORK" "$DEVICE" "$(( $(date +%s) - START ))" "$BACKEND" <<'EOF'
"""Render the runs' JSON reports and the FSDP table as one markdown table."""
import json
import platform
import sys

import torch

out, work, device, seconds, backend = sys.argv[1:6]
FSDP_MODES = ("fsdp", "dp-fsdp-bk", "dp-fsdp-hooks", "dp-fsdp-ghost", "ddp", "dp-ddp-bk")
HEAD = ("workload", "setting", "variant", "step ms", "x non-private", "x eager", "peak MiB",
        "mem x non-private", "graphs", "graph breaks")


def num(value, spec=".2f"):
    return "-" if value is None else format(value, spec)


def benchmark_rows(name, setting):
    """Rows of one scripts/benchmark.py report; compiled rows against compiled non-private."""
    with open(f"{work}/{name}.json") as f:
        report = json.load(f)
    for model, entry in report["models"].items():
        for variant, row in entry["variants"].items():
            raw = entry["raw_timing"][variant]
            if row["error"]:
                yield (model, setting, variant, f"unsupported: {row['error'][:90]}") + ("-",) * 6
                continue
            compiled = "@" in variant
            ratio = raw.get("paired_x_compiled_non_private") if compiled else row["paired_x_non_private"]
            graphs = raw.get("graphs", {})
            yield (model, setting, variant, num(row["ms"], ".1f"), num(ratio), num(raw.get("paired_x_eager")),
                   num(row["peak_mib"], ".1f"), num(row["mem_x_non_private"]),
                   num(graphs.get("graphs"), "d"), num(graphs.get("graph_breaks"), "d"))


def fsdp_rows():
    """Rows of the "W = 1" table benchmark_distributed.py --fsdp prints (8 columns a mode)."""
    in_table, peaks, rows = False, {}, []
    with open(f"{work}/fsdp.log") as f:
        for line in f:
            words = line.split()
            if words[:3] == ["W", "=", "1"]:
                in_table = True
            elif in_table and len(words) == 8 and words[0] in FSDP_MODES:
                mode, ms, ratio, peak = words[0], float(words[1]), float(words[2]), float(words[4])
                peaks[mode] = peak
                rows.append([mode, ms, ratio, peak])
            elif in_table and not words:
                in_table = False
    base = {"dp-fsdp-bk": "fsdp", "dp-fsdp-hooks": "fsdp", "dp-fsdp-ghost": "fsdp", "dp-ddp-bk": "ddp"}
    for mode, ms, ratio, peak in rows:
        mem = peak / peaks[base.get(mode, mode)] if peaks.get(base.get(mode, mode)) else None
        yield ("fsdp2 MLP 16.8M" if device == "cuda" else "fsdp2 MLP (tiny)", "fp32, W=1", mode,
               num(ms, ".2f"), num(ratio), "-", num(peak, ".1f"), num(mem), "-", "-")


def cpu_name():
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return f"CPU ({names[0] if names else platform.processor() or platform.machine()})"


def main():
    name = torch.cuda.get_device_name() if device == "cuda" else cpu_name()
    rows = [*benchmark_rows("fp32", "fp32"), *benchmark_rows("bf16", "bf16"),
            *benchmark_rows("compile", f"fp32, compile ({backend})"),
            *benchmark_rows("compile_ddp", f"fp32, DDP W=1, compile ({backend})"), *fsdp_rows()]
    lines = [f"# DP-SGD against non-private training on {name}", "",
             f"Device: {name}; torch {torch.__version__}; {seconds} s in all "
             f"(`scripts/gpu_benchmark.sh --device {device}`).", "",
             "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    lines += ["", "x non-private: median over rounds of time / non-private time of the same round "
              "(compiled rows `name@backend`: / compiled non-private; fsdp rows: / fsdp, dp-ddp-bk / ddp). "
              "x eager: compiled / eager time of the same variant in the compile run. Graphs and graph breaks: "
              "Dynamo's counters over two steps on fresh caches."]
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {out}: {len(rows)} rows, {seconds} s")


main()
EOF
