# Sourced by scripts/test.sh and scripts/main_job.sh: create ./.venv (or $OPACUS_DP_VENV) if
# absent and install the package editable with the extras given as $1 (e.g. "test,examples").
VENV="${OPACUS_DP_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
fi
"$VENV/bin/pip" install --quiet -e ".[$1]"
