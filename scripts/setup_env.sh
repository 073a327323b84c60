#!/usr/bin/env bash
# Set up (idempotently) the te_passes environment on a CPU machine of this project's kind:
#   a venv with torch $TORCH (default 2.15.0; 2.14.1 also supported), Transformer Engine 2.20.2 built
#   from source against that torch (about 10-15 minutes the first time, see ../shared/README.md), and
#   this package (editable, dev extras). One venv per torch version, so switching does not rebuild.
# A second run checks installed versions only and finishes in seconds.
# Env: TORCH (2.15.0 | 2.14.1), TE_PASSES_VENV (default ~/.cache/te_passes/venv-torch$TORCH),
#      PYTHON (default python3), MAX_JOBS (TE compile jobs, default 2).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TORCH_V=${TORCH:-2.15.0}; TE_V=2.20.2
case "$TORCH_V" in
  2.15.0) CUDA_TK=13.2.2 ;;  # torch 2.15.0: cu132 build, triton 3.9
  2.14.1) CUDA_TK=13.0.3 ;;  # torch 2.14.1: cu130 build, triton 3.8
  *) echo "setup: TORCH=$TORCH_V is not supported (supported: 2.15.0, 2.14.1; docs/install.md)" >&2; exit 2 ;;
esac
VENV=${TE_PASSES_VENV:-$HOME/.cache/te_passes/venv-torch$TORCH_V}
PY=${PYTHON:-python3}
# Our own pins for every pip call into this venv. PIP_CONSTRAINT replaces a machine-wide constraint
# from pip's configuration (pip config list; here /etc/xdg/pip caps torch at 2.14.1) for these calls only.
export PIP_CONSTRAINT="$ROOT/scripts/constraints/torch-$TORCH_V.txt"
if [ -t 1 ]; then  # bold step lines on a terminal only: no ANSI codes in pipes and CI logs
  step() { printf '\033[1m[setup %s]\033[0m %s\n' "$1" "$2"; }
else
  step() { printf '[setup %s] %s\n' "$1" "$2"; }
fi

filter() { grep -v "^WARNING: Location" || true; }  # pip's noise; pip's own status survives (pipefail)

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
  step 1/5 "creating venv $VENV (torch $TORCH_V)"
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip 2>&1 | filter || true
else
  step 1/5 "venv $VENV exists"
fi
PIP=("$VENV/bin/pip" install --progress-bar on)
# The torch transformer_engine_torch was compiled against: a TE extension built for another torch is
# an ABI mismatch, so TE is rebuilt whenever this differs from the venv's torch.
TE_STAMP="$VENV/.te_built_against_torch"

# curand listed explicitly: torch 2.15.0 dropped it from its cuda-toolkit extras and TE's import
# loads it ("RuntimeError: curand shared object not found").
if have torch "$TORCH_V" && have cuda-toolkit $CUDA_TK && have nvidia-curand '*' && have ninja '*' \
    && have pybind11 '*' && have wheel '*'; then
  step 2/5 "torch $TORCH_V and build deps present"
else
  step 2/5 "installing torch $TORCH_V (cuda-toolkit $CUDA_TK) and TE build deps"
  have transformer_engine_torch '*' && ! have torch "$TORCH_V" && echo "another torch" > "$TE_STAMP"
  "${PIP[@]}" "torch==$TORCH_V" "cuda-toolkit[crt,cccl,curand]==$CUDA_TK" ninja wheel pybind11 numpy setuptools 2>&1 | filter
fi

if [ ! -f "$TE_STAMP" ] && have transformer_engine_torch '*'; then
  echo "$TORCH_V" > "$TE_STAMP"  # a venv set up before this stamp existed: TE was built with its torch
fi
if have transformer_engine $TE_V && have transformer_engine_torch $TE_V \
    && [ "$(cat "$TE_STAMP" 2>/dev/null)" = "$TORCH_V" ]; then
  step 3/5 "Transformer Engine $TE_V (built against torch $TORCH_V) present"
else
  step 3/5 "building Transformer Engine $TE_V against torch $TORCH_V (10-15 minutes: compiles transformer_engine_torch)"
  # --no-cache-dir: pip would otherwise reuse a cached transformer_engine_torch wheel built against
  # another torch version; --force-reinstall of that one wheel when only the torch changed.
  WHAT=("transformer-engine[pytorch]==$TE_V")
  if have transformer_engine_torch '*'; then WHAT=(--force-reinstall --no-deps "transformer_engine_torch==$TE_V"); fi
  NVTE_BUILD_USE_NVIDIA_WHEELS=1 MAX_JOBS=${MAX_JOBS:-2} NVTE_FRAMEWORK=pytorch \
    "${PIP[@]}" --no-cache-dir --no-build-isolation "${WHAT[@]}" 2>&1 | filter
  "$VENV/bin/python" -c "import torch, transformer_engine.pytorch" \
    || { echo "setup: transformer_engine.pytorch does not import with torch $TORCH_V (see above)" >&2; exit 1; }
  echo "$TORCH_V" > "$TE_STAMP"
fi

if have pytest '*' && have hypothesis '*' && have rich '*' && have pytest-timeout '*' && have import-linter '*'; then
  step 4/5 "dev tools present"
else
  step 4/5 "installing dev tools (pytest, hypothesis, rich, import-linter)"
  "${PIP[@]}" pytest hypothesis rich pytest-timeout import-linter 2>&1 | filter
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
