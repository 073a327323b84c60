#!/bin/bash
# Issue 8 scenarios on the 2-GPU H200 machine (see benchmarks/sp_fp8_tp2.py): an fp8
# sequence-parallel te.Linear pair must compile on the first call under te_inductor.
#   bash benchmarks/sp_fp8_tp2.sh [OUT_DIR] [extra sp_fp8_tp2.py args, given to every launch...]
# Needs torch 2.14.1 + TE 2.20.2 (../shared/gpu-kit: `source .gpu/s/env.sh` first on the device).
# Every scenario is its own torchrun launch (what is loaded before the first compile is what is
# tested), one after the other; logs and JSON go to OUT_DIR. Exit status: 1 when any launch failed
# (the "inductor" launch fails only when te_passes got loaded there: it records what TE does alone).
# NVLink multicast stays off (UB_SKIPMC=1 and the NCCL/PyTorch/NVSHMEM switches): it can put the
# host's shared GPUs out of service.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-sp_fp8_tp2_out}}; shift || true
mkdir -p "$OUT_DIR"
export UB_SKIPMC=1 CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
       NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export TORCH_LOGS=${TORCH_LOGS:-recompiles,graph_breaks}
export TE_PASSES_COMMIT=${TE_PASSES_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}

status=0
launch() {  # launch NAME ARGS...
  local name=$1; shift
  echo "=== sp_fp8_tp2 $name: $* ($(date -u +%H:%M:%S))"
  local t0=$SECONDS
  # A rank whose compiled call fails while the other's succeeds can leave the other waiting in a
  # collective: each launch gets a time limit (SP_FP8_TP2_LAUNCH_TIMEOUT_S, default 240 s).
  timeout -k 15 "${SP_FP8_TP2_LAUNCH_TIMEOUT_S:-240}" \
    python3 -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/sp_fp8_tp2.py \
      --out "$OUT_DIR" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== sp_fp8_tp2 $name: exit $rc, $((SECONDS - t0)) s"
  return "$rc"
}

# 1. TE alone (te_passes never imported): one alternating step is enough to show the re-arm.
launch inductor --scenario inductor --alt-steps 1 "$@" || status=1
# 2. te_inductor, default then reduce-overhead: the first mode's first call tests the sweep at
#    backend lookup, the second the per-call release (eager steps with te_passes loaded).
launch te_inductor --scenario te_inductor "$@" || status=1
# 3. reduce-overhead as the first compile of its process (the sweep path under cudagraphs).
launch te_inductor_ro_first --scenario te_inductor --modes reduce-overhead "$@" || status=1
# 4. with Userbuffers, default then reduce-overhead.
launch te_inductor_ub --scenario te_inductor_ub "$@" || status=1

echo "=== summaries"
grep -h "SUMMARY\|FAILURE" "$OUT_DIR"/inductor.log "$OUT_DIR"/te_inductor*.log | sed 's/^\[rank [0-9]\] //' || true
echo "=== sp_fp8_tp2: $([ $status = 0 ] && echo PASS || echo FAIL) (JSON: $OUT_DIR/sp_fp8_tp2_*.json)"
exit $status
