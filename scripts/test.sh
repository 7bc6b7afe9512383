#!/usr/bin/env bash
# Run the opacus_dp test suite. Creates ./.venv (if absent) with the package and its
# test + example extras, then runs pytest on tests/. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${OPACUS_DP_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
fi
"$VENV/bin/pip" install --quiet -e ".[test,examples]"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Refuse a run that collects too few tests (pytest's own exit 5 covers zero).
collected=$("$VENV/bin/python" -m pytest --collect-only -q "$@" | grep -cE '::' || true)
echo "collected $collected tests"
if [ "$collected" -lt "${OPACUS_DP_MIN_TESTS:-50}" ]; then
  echo "error: only $collected tests collected; the suite is incomplete" >&2
  exit 1
fi
exec "$VENV/bin/python" -m pytest -n "${PYTEST_WORKERS:-2}" --dist loadfile "$@"
