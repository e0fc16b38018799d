#!/usr/bin/env bash
# Installs the CUDA compile tools that the no-GPU kernel check needs (NVRTC, the CUDA runtime
# headers, ptxas) from PyPI wheels into a cache folder, and prints the variables to export.
#
#   eval "$(bash scripts/cuda-tools.sh)"
#
# No GPU, driver or CUDA toolkit is needed. The versions are pinned to CUDA 13.0: NVRTC 13.0
# emits PTX ISA 9.0, the newest that the GPU machine's driver (580, CUDA 13.0) loads; a newer
# NVRTC would emit PTX that driver rejects. About 130 MB to download, 336 MB installed.
# Progress goes to stderr; only the `export` lines go to stdout.
set -euo pipefail

CUDA_PY="${CUDA_PY:-$HOME/.cache/dtensor/cuda-py-13.0}"
wheels=(nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96)
C="$CUDA_PY/nvidia/cu13"

if [ -e "$C/bin/ptxas" ] && [ -e "$C/include/cuda_runtime.h" ] && ls "$C"/lib/libnvrtc.so.13* >/dev/null 2>&1; then
  echo "cuda-tools: already installed in $CUDA_PY" >&2
else
  if ! python3 -m pip --version >/dev/null 2>&1; then
    echo "cuda-tools: installing python3-pip" >&2
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
    $SUDO apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-pip >&2
  fi
  echo "cuda-tools: installing ${wheels[*]} into $CUDA_PY" >&2
  mkdir -p "$CUDA_PY"
  # --target: no virtual environment needed; --no-deps: the three wheels are self-contained.
  # --break-system-packages is harmless with --target but needed by Debian's pip to run at all.
  flags=(-q --disable-pip-version-check --no-deps --upgrade --target "$CUDA_PY")
  if python3 -m pip install --help 2>/dev/null | grep -q -- --break-system-packages; then
    flags+=(--break-system-packages)
  fi
  python3 -m pip install "${flags[@]}" "${wheels[@]}" >&2
fi

for f in "$C/bin/ptxas" "$C/include/cuda_runtime.h"; do
  [ -e "$f" ] || { echo "cuda-tools: $f missing after install" >&2; exit 1; }
done
ls "$C"/lib/libnvrtc.so.13* >/dev/null 2>&1 || { echo "cuda-tools: libnvrtc.so.13 missing in $C/lib" >&2; exit 1; }

echo "export LD_LIBRARY_PATH=\"$C/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}\""
echo "export CUDA_INCLUDE=\"$C/include\""
echo "export PTXAS=\"$C/bin/ptxas\""
