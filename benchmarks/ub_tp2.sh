#!/bin/bash
# One command for the Userbuffers TP=2 scenario on the 2-GPU H200 machine (see benchmarks/ub_tp2.py).
#   bash benchmarks/ub_tp2.sh [OUT_DIR] [extra ub_tp2.py args...]
# Needs torch 2.14.1 + TE 2.20.2 (../shared/gpu-kit: `source .gpu/s/env.sh` first on the device).
# NVLink multicast stays off (UB_SKIPMC=1 and the NCCL/PyTorch/NVSHMEM switches): it can put the
# host's shared GPUs out of service.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-ub_tp2_out}}; shift || true
export UB_SKIPMC=1 CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
       NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
exec python3 -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/ub_tp2.py --out "$OUT_DIR" "$@"
