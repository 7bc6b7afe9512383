# Sourced by scripts/test.sh and scripts/main_job.sh: create ./.venv (or $OPACUS_DP_VENV) if
# absent and install this checkout editable with the extras given as $1 (e.g. "test,examples").
#
# The install is skipped when the stamp file in the venv says that this checkout is installed
# with (at least) these extras and that setup.py and opacus_dp/version.py have not changed since
# (the code itself needs no reinstall: the install is editable). pip's output goes to
# $VENV/pip-install.log and is printed only when pip fails.
VENV="${OPACUS_DP_VENV:-.venv}"
_OPACUS_DP_STAMP="$VENV/opacus_dp-install.stamp"
_OPACUS_DP_LOG="$VENV/pip-install.log"

_opacus_dp_pip() {  # pip "$@", quiet unless it fails
  if ! "$VENV/bin/python" -m pip "$@" >>"$_OPACUS_DP_LOG" 2>&1; then
    echo "error: pip $* failed; its output (from $_OPACUS_DP_LOG):" >&2
    cat "$_OPACUS_DP_LOG" >&2
    return 1
  fi
}

_opacus_dp_fingerprint() {  # what the install depends on, besides the extras
  { cat setup.py opacus_dp/version.py; printf '%s\n' "$PWD"; } \
    | "$VENV/bin/python" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())'
}

_opacus_dp_installed() {  # true if the stamp covers fingerprint $1 and every extra in $2
  [ -f "$_OPACUS_DP_STAMP" ] || return 1
  local stamp_hash stamp_extras extra
  { read -r stamp_hash; read -r stamp_extras; } <"$_OPACUS_DP_STAMP" || return 1
  [ "$stamp_hash" = "$1" ] || return 1
  for extra in ${2//,/ }; do
    case ",$stamp_extras," in *",$extra,"*) ;; *) return 1 ;; esac
  done
  # The package must import from this checkout (-I: not from the current directory).
  "$VENV/bin/python" -I -c 'import os, sys, opacus_dp
sys.exit(os.path.dirname(os.path.realpath(opacus_dp.__file__)) != os.path.realpath(sys.argv[1]))' \
    "$PWD/opacus_dp" 2>/dev/null
}

if [ ! -x "$VENV/bin/python" ]; then
  echo "creating $VENV ..." >&2
  python3 -m venv "$VENV" || exit 1
  : >"$_OPACUS_DP_LOG"
  _opacus_dp_pip install --upgrade pip || exit 1
fi
_opacus_dp_hash=$(_opacus_dp_fingerprint) || exit 1
if ! _opacus_dp_installed "$_opacus_dp_hash" "$1"; then
  _opacus_dp_extras="$1"
  if [ -f "$_OPACUS_DP_STAMP" ] && [ "$(head -n 1 "$_OPACUS_DP_STAMP")" = "$_opacus_dp_hash" ]; then
    _opacus_dp_extras="$(sed -n 2p "$_OPACUS_DP_STAMP"),$1"  # same setup.py: the old extras stay
  fi
  _opacus_dp_extras=$(printf '%s' "$_opacus_dp_extras" | tr ',' '\n' | sed '/^$/d' | sort -u | paste -sd, -)
  echo "installing opacus_dp[$_opacus_dp_extras] into $VENV (pip log: $_OPACUS_DP_LOG) ..." >&2
  rm -f "$_OPACUS_DP_STAMP"
  : >"$_OPACUS_DP_LOG"
  _opacus_dp_pip install -e ".[$_opacus_dp_extras]" || exit 1
  printf '%s\n%s\n' "$_opacus_dp_hash" "$_opacus_dp_extras" >"$_OPACUS_DP_STAMP"
fi
unset _opacus_dp_hash _opacus_dp_extras
