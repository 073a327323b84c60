#!/usr/bin/env bash
# Set up (idempotently) the te_passes environment on a CPU machine of this project's kind:
#   a venv with torch 2.14.1 (CUDA 13.0 build), Transformer Engine 2.20.2 built from source
#   (about 10 minutes the first time, see ../shared/README.md), and this package (editable, dev extras).
# A second run checks installed versions only and finishes in seconds.
# Env: TE_PASSES_VENV (default ~/.cache/te_passes/venv), PYTHON (default python3).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${TE_PASSES_VENV:-$HOME/.cache/te_passes/venv}
PY=${PYTHON:-python3}
TORCH_V=2.14.1; TE_V=2.20.2
if [ -t 1 ]; then  # bold step lines on a terminal only: no ANSI codes in pipes and CI logs
  step() { printf '\033[1m[setup %s]\033[0m %s\n' "$1" "$2"; }
else
  step() { printf '[setup %s] %s\n' "$1" "$2"; }
fi

have() {  # have DIST VERSION  -> installed version equals VERSION
  "$VENV/bin/python" - "$1" "$2" <<'PYEOF' 2>/dev/null
import importlib.metadata as m, sys
try:
    v = m.version(sys.argv[1])
except m.PackageNotFoundError:
    sys.exit(1)
want = sys.argv[2]
have = v.split("+")[0]
# "13.0.3" is satisfied by "13.0.3" and "13.0.3.0" (pip normalises trailing zeros away).
norm = lambda s: [int(p) if p.isdigit() else p for p in s.split(".")]
pad = lambda a, n: a + [0] * (n - len(a))
ok = want == "*" or pad(norm(have), 4) == pad(norm(want), 4)
sys.exit(0 if ok else 1)
PYEOF
}

if [ ! -x "$VENV/bin/python" ]; then
  step 1/5 "creating venv $VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
else
  step 1/5 "venv $VENV exists"
fi
PIP=("$VENV/bin/pip" install --progress-bar on)

if have torch $TORCH_V && have cuda-toolkit 13.0.3 && have ninja '*' && have pybind11 '*' && have wheel '*'; then
  step 2/5 "torch $TORCH_V and build deps present"
else
  step 2/5 "installing torch $TORCH_V (CUDA 13.0 build) and TE build deps"
  "${PIP[@]}" "torch==$TORCH_V" 'cuda-toolkit[crt,cccl]==13.0.3' ninja wheel pybind11 numpy setuptools 2>&1 | grep -v "^WARNING: Location"
fi

if have transformer_engine $TE_V && have transformer_engine_torch $TE_V; then
  step 3/5 "Transformer Engine $TE_V present"
else
  step 3/5 "building Transformer Engine $TE_V (about 10 minutes: compiles transformer_engine_torch)"
  NVTE_BUILD_USE_NVIDIA_WHEELS=1 MAX_JOBS=${MAX_JOBS:-2} NVTE_FRAMEWORK=pytorch \
    "${PIP[@]}" --no-build-isolation "transformer-engine[pytorch]==$TE_V" 2>&1 | grep -v "^WARNING: Location"
fi

if have pytest '*' && have hypothesis '*' && have rich '*' && have pytest-timeout '*' && have import-linter '*'; then
  step 4/5 "dev tools present"
else
  step 4/5 "installing dev tools (pytest, hypothesis, rich, import-linter)"
  "${PIP[@]}" pytest hypothesis rich pytest-timeout import-linter 2>&1 | grep -v "^WARNING: Location"
fi

# Editable install, re-pointed when this checkout moved (CI clones elsewhere) or pyproject changed.
STAMP="$VENV/.te_passes_editable"
WANT="$ROOT $(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && have te-passes '*'; then
  step 5/5 "te_passes installed (editable) from $ROOT"
else
  step 5/5 "installing te_passes (editable) from $ROOT"
  "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e "$ROOT" >"$VENV/.te_passes_install.log" 2>&1 || { cat "$VENV/.te_passes_install.log" >&2; exit 1; }
  have te-passes '*' || { echo "setup: editable install of te_passes failed" >&2; exit 1; }
  echo "$WANT" > "$STAMP"
fi
echo "setup: ready — $VENV/bin/python (torch $TORCH_V, transformer_engine $TE_V, te_passes editable)"
