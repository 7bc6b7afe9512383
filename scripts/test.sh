#!/usr/bin/env bash
# Run the opacus_dp test suite. Creates ./.venv (if absent) with the package and its
# test + example + hf (transformers, for tests/hf) + lightning extras, then runs pytest on tests/. Extra
# arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/ensure_venv.sh "test,examples,hf,lightning"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Refuse a run that collects too few tests (pytest's own exit 5 covers zero): the whole
# suite has several hundred tests, so a broken collection cannot pass as a green run.
if [ "$#" -eq 0 ]; then min_tests="${OPACUS_DP_MIN_TESTS:-500}"; else min_tests=1; fi
collected=$("$VENV/bin/python" scripts/collected_tests.py "$@")
echo "collected $collected tests"
if [ "$collected" -lt "$min_tests" ]; then
  echo "error: only $collected tests collected; the suite is incomplete" >&2
  exit 1
fi
exec "$VENV/bin/python" -m pytest -n "${PYTEST_WORKERS:-2}" --dist loadfile "$@"
