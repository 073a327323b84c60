#!/bin/bash
# One command for the Userbuffers TP=2 scenario on the 2-GPU H200 machine (see benchmarks/ub_tp2.py).
#   bash benchmarks/ub_tp2.sh [OUT_DIR] [extra ub_tp2.py args, given to every launch...]
# Needs torch 2.14.1 + TE 2.20.2 (../shared/gpu-kit: `source .gpu/s/env.sh` first on the device).
# Two torchrun launches, one per torch.compile mode (reduce-overhead, then default): phase 1
# (te_inductor vs eager) and phase 2 (UB re-initialised with a config TE supports: only the
# graphs that read the changed UB state recompile). Logs and ub_tp2_<mode>.json go to OUT_DIR.
# UB_TP2_MODES picks the launches (default "reduce-overhead default"); each launch is limited to
# UB_TP2_LAUNCH_TIMEOUT_S (default 270 s). Exit status 1 when a launch failed. NVLink multicast stays off (UB_SKIPMC=1 and the
# NCCL/PyTorch/NVSHMEM switches): it can put the host's shared GPUs out of service.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-ub_tp2_out}}; shift || true
mkdir -p "$OUT_DIR"
export UB_SKIPMC=1 CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
       NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export TORCH_LOGS=${TORCH_LOGS:-recompiles,graph_breaks}

status=0
for mode in ${UB_TP2_MODES:-reduce-overhead default}; do
  echo "=== ub_tp2 --mode $mode ($(date -u +%H:%M:%S))"
  t0=$SECONDS
  timeout -k 15 "${UB_TP2_LAUNCH_TIMEOUT_S:-270}" \
    python3 -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/ub_tp2.py \
      --out "$OUT_DIR" --mode "$mode" "$@" 2>&1 | tee "$OUT_DIR/ub_tp2_$mode.log"
  rc=${PIPESTATUS[0]}
  echo "=== ub_tp2 --mode $mode: exit $rc, $((SECONDS - t0)) s"
  [ "$rc" = 0 ] || status=1
done
echo "=== summaries"
grep -h "SUMMARY\|FAIL" "$OUT_DIR"/ub_tp2_*.log | sed 's/^\[rank [0-9]\] //' || true
echo "=== ub_tp2: $([ $status = 0 ] && echo PASS || echo FAIL) (JSON: $OUT_DIR/ub_tp2_<mode>.json)"
exit $status
