#!/usr/bin/env bash
# torch 2.15.0 on the device image (../shared/gpu-kit with TORCH_V=2.15.0 TRITON_V=3.9.0): the kit links the
# image's nvidia/nvshmem, older than the NVSHMEM 3.7 torch 2.15.0 needs ("libtorch_nvshmem.so: undefined symbol:
# nvshmem_selected_device_transport, version NVSHMEM", docs/benchmarks.md "Session 19"). This brings
# nvidia-nvshmem-cu13 3.7.2 along, like the kit brings NCCL.
#   here (CPU):  bash scripts/gpu/nvshmem_215.sh pack      -> .gpu15/nv1 .. nv3 (<= 44 MiB each)
#   device:      bash scripts/gpu/nvshmem_215.sh install   (carry one .gpu15/nvN per call, in order, BEFORE the kit's
#                step that starts the build; the last call installs into $TEK/nvshmem and links it where
#                torch's RPATH looks: $TEK/site/nvidia/nvshmem, which build.sh then leaves alone)
set -euo pipefail
G=${GPU_DIR:-.gpu15}; TEK=${TEK:-/root/tek}; V=3.7.2
case "${1:?usage: nvshmem_215.sh pack|install}" in
  pack)
    mkdir -p "$G/nvdl"
    PIP_CONSTRAINT= python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$G/nvdl" "nvidia-nvshmem-cu13==$V"
    whl=$(ls "$G"/nvdl/nvidia_nvshmem_cu13-$V-*.whl)
    rm -rf "$G"/nv[0-9]; (cd "$G/nvdl" && split -b 44M -d -a 1 "$(basename "$whl")" part.)
    i=1; for p in "$G"/nvdl/part.*; do mkdir -p "$G/nv$i"; mv "$p" "$G/nv$i/"; i=$((i + 1)); done
    sha256sum "$whl" | cut -c1-64 > "$G/s/nvshmem.sha256"; basename "$whl" > "$G/s/nvshmem.name"
    ls -d "$G"/nv[0-9] ;;
  install)
    mkdir -p "$TEK/nvin"; for d in "$G"/nv[0-9]; do [ -d "$d" ] && mv -f "$d"/part.* "$TEK/nvin/" 2>/dev/null || true; done
    n=$(ls "$TEK"/nvin/part.* | wc -l); echo "nvshmem parts here: $n"
    name=$(cat "$G/s/nvshmem.name")
    cat $(ls "$TEK"/nvin/part.* | sort) > "$TEK/nvin/$name"
    if [ "$(sha256sum "$TEK/nvin/$name" | cut -c1-64)" != "$(cat "$G/s/nvshmem.sha256")" ]; then
      rm -f "$TEK/nvin/$name"; echo "nvshmem: not whole yet (or a bad part)"; exit 0; fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$TEK/nvshmem" "$TEK/nvin/$name"
    mkdir -p "$TEK/site/nvidia"; ln -sfn "$TEK/nvshmem/nvidia/nvshmem" "$TEK/site/nvidia/nvshmem"
    echo "nvshmem $V installed: $TEK/site/nvidia/nvshmem -> $TEK/nvshmem/nvidia/nvshmem" ;;
esac
