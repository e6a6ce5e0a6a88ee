#!/usr/bin/env bash
# Source on the GPU machine before running the CUDA build of tensorport or its GPU tests:
#
#   source scripts/gpu-env.sh        (or dist/gpu/gpu-env.sh, which scripts/build-gpu.sh copies there)
#
# libcuda comes with the driver; cuBLAS, NVRTC and cuRAND (which dfdx loads) come with a CUDA 13
# toolkit or with PyTorch's nvidia wheels, and cuDNN 9 (the model's convolutions) with NVIDIA's
# cudnn9 package or the `nvidia-cudnn-cu13` wheel. This puts the folders that exist on LD_LIBRARY_PATH,
# keeping what was there, and never a `stubs` folder: a link-time stub libcuda found first makes
# every driver call fail with CUDA error 999.
_tp_dirs=(/usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/nvidia/lib64)
for _tp_site in /opt/*/.venv/lib/python3*/site-packages /usr/local/lib/python3*/dist-packages \
  "$HOME"/.local/lib/python3*/site-packages; do
  _tp_dirs+=("$_tp_site/nvidia/cu13/lib" "$_tp_site/nvidia/cudnn/lib")
done
IFS=: read -r -a _tp_old <<< "${LD_LIBRARY_PATH:-}"
_tp_path=""
for _tp_d in "${_tp_dirs[@]}" "${_tp_old[@]}"; do
  [[ -n "$_tp_d" && -d "$_tp_d" && "$_tp_d" != *stubs* ]] || continue
  [[ ":$_tp_path:" == *":$_tp_d:"* ]] || _tp_path="$_tp_path:$_tp_d"
done
export LD_LIBRARY_PATH="${_tp_path#:}"
unset _tp_dirs _tp_site _tp_old _tp_path _tp_d
