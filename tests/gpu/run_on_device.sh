#!/bin/bash
# Run the GPU suite / benchmark on the device machine, after the ../shared/gpu-kit bring-up
# (which leaves torch 2.14.1 + TE 2.20.2 in $TEK, default /root/tek; the kit's `s` folder must be carried:
# `.gpu/s`, or `.gpu15/s` with GPU_DIR=.gpu15 for the torch 2.15.0 kit).
#   bash tests/gpu/run_on_device.sh suite   # pytest -m gpu tests/  (every gpu-marked test of the repo)
#   bash tests/gpu/run_on_device.sh pytest FILE[::TEST]... # chosen gpu-marked tests
#   bash tests/gpu/run_on_device.sh bench   # benchmarks/bench_gpu.py (extra args are passed on)
#   bash tests/gpu/run_on_device.sh hostprof # benchmarks/bench_host_profile.py (issue 13)
#   bash tests/gpu/run_on_device.sh chunk NAME... # benchmarks/gpu_plan.py chunks in order ($OUT/NAME/, $OUT/NAME.log)
#   bash tests/gpu/run_on_device.sh ub      # benchmarks/ub_tp2.sh (2-GPU machine)
#   bash tests/gpu/run_on_device.sh sp      # benchmarks/sp_fp8_tp2.sh (2-GPU machine; issue 8)
# Logs and results go to $OUT (default /tmp/gpu_out). te_passes is installed editable (no deps,
# offline) so backend="te_inductor" resolves through its entry point, as for users.
set -uo pipefail
cd "$(dirname "$0")/../.."
what=${1:?usage: run_on_device.sh suite|pytest|bench|hostprof|chunk|ub|sp [args...]}; shift
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
source "${GPU_DIR:-.gpu}/s/env.sh"
export TE_PASSES_COMMIT=${TE_PASSES_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
if ! python3 -c "import importlib.metadata as m; m.distribution('te-passes')" 2>/dev/null; then
  if python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/tmp/pip_install.log 2>&1; then
    echo "te_passes: editable install done"
  else
    echo "te_passes: editable install FAILED (tail of /tmp/pip_install.log below); the harness registers the backend by hand"
    tail -5 /tmp/pip_install.log
  fi
fi
python3 - <<'PY'
import torch, transformer_engine, transformer_engine.pytorch.utils as u
from te_passes.testing.gpu import ensure_te_inductor_backend
print(f"torch {torch.__version__} cuda {torch.version.cuda} | TE {transformer_engine.__version__} | "
      f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()} | TE compile path "
      f"{'ON' if u._compile_disabled_reason is None else 'OFF: ' + str(u._compile_disabled_reason)} | "
      f"te_inductor via {ensure_te_inductor_backend()}")
PY
case "$what" in
  suite)
    # every gpu-marked test (tests/gpu/conftest.py runs test_te_inductor_gpu.py first);
    # SIGINT before the device call's limit lets pytest print its summary and write the JUnit XML.
    # -o log_level=INFO: torch's structured-trace logger (torch.__trace) logs empty DEBUG records on every compile,
    # ~25,000 lines per call under -rA
    timeout -s INT "${SUITE_TIMEOUT_S:-560}" python3 -m pytest -m gpu tests/ -o log_level=INFO \
      -v -rA -p no:cacheprovider --timeout 400 --junitxml="$OUT/gpu_suite.xml" "$@" 2>&1 | tee "$OUT/gpu_suite.log"
    exit "${PIPESTATUS[0]}" ;;
  pytest)  # chosen gpu-marked tests: run_on_device.sh pytest tests/gpu/test_x.py::test_y ...
    timeout -s INT "${SUITE_TIMEOUT_S:-560}" python3 -m pytest -m gpu -v -rA -o log_level=INFO -p no:cacheprovider --timeout 400 \
      --junitxml="$OUT/gpu_pytest.xml" "$@" 2>&1 | tee "$OUT/gpu_pytest.log"
    exit "${PIPESTATUS[0]}" ;;
  bench)
    python3 benchmarks/bench_gpu.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
    exit "${PIPESTATUS[0]}" ;;
  hostprof)  # issue 13: host-time split per step
    python3 benchmarks/bench_host_profile.py --out "$OUT" "$@" 2>&1 | tee "$OUT/host_profile.log"
    exit "${PIPESTATUS[0]}" ;;
  chunk)  # the GPU session plan (benchmarks/gpu_plan.md): one or more chunks, one after the other
    rc=0
    for name in "$@"; do
      cmd=$(python3 benchmarks/gpu_plan.py --command "$name") || exit 2
      echo "== chunk $name: $cmd"
      eval "$cmd" 2>&1 | tee "$OUT/$name.log"; rc=$(( rc | PIPESTATUS[0] ))
    done
    exit "$rc" ;;
  ub)
    bash benchmarks/ub_tp2.sh "$OUT" "$@" 2>&1 | tee "$OUT/ub_tp2.log"
    exit "${PIPESTATUS[0]}" ;;
  sp)
    bash benchmarks/sp_fp8_tp2.sh "$OUT" "$@" 2>&1 | tee "$OUT/sp_fp8_tp2.log"
    exit "${PIPESTATUS[0]}" ;;
  *) echo "unknown: $what" >&2; exit 2 ;;
esac
