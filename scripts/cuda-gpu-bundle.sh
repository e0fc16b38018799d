#!/usr/bin/env bash
# Builds the CUDA test binaries here and packs them, stripped, into .gpu/ (git-ignored), with a
# runner for a GPU machine that has no Rust toolchain:
#
#   bash scripts/cuda-gpu-bundle.sh          # here
#   bash .gpu/run.sh                          # there (copy .gpu/ over first; it is git-ignored,
#                                             # so a tool that ships the working tree must be told to carry it)
#
# run.sh looks for the CUDA 13 NVRTC and cuBLAS libraries and libnccl (system or pip wheels),
# puts their folders on LD_LIBRARY_PATH (with a `libnccl.so` link to the wheel's
# `libnccl.so.2`, the only name cudarc does not try), and runs every test, the GPU-only ones
# included: the CUDA kernels, then the NCCL backend (`NCCL_SOCKET_IFNAME=lo`,
# `NCCL_MULTI_RANK_GPU_ENABLE=1` for ranks sharing a GPU, `DTENSOR_GPU_REQUIRED=1` so that a
# missing library fails instead of skipping).
set -euo pipefail
cd "$(dirname "$0")/.."

out=.gpu
mkdir -p "$out"
# .gpu/ is in .gitignore.

bins=$(cargo test -p dtensor-kernels --features cuda --test cuda_gpu --test cuda_gpu_model --test cuda_ptx --no-run \
  --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])')
while read -r name path; do
  cp "$path" "$out/$name"
  strip "$out/$name"
done <<< "$bins"
nccl_bin=$(cargo test -p dtensor-collectives --features nccl --test nccl --no-run \
  --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["executable"])')
cp "$nccl_bin" "$out/nccl"
strip "$out/nccl"

cat > "$out/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs the CUDA tests on a GPU machine (see scripts/cuda-gpu-bundle.sh).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dirs=""
for lib in 'libnvrtc.so.1[23]*' 'libcublas.so.1[23]*' 'libcublasLt.so.1[23]*'; do
  f=$(find / -xdev -name "$lib" -not -path '*/proc/*' 2>/dev/null | head -n 1)
  if [ -n "$f" ]; then
    d=$(dirname "$f")
    case ":$dirs:" in *":$d:"*) ;; *) dirs="$dirs${dirs:+:}$d" ;; esac
  else
    echo "run.sh: $lib not found on this machine" >&2
  fi
done
nccl=$(find / -xdev -name 'libnccl.so.2*' -not -path '*/proc/*' 2>/dev/null | head -n 1)
if [ -n "$nccl" ]; then
  mkdir -p "$here/shim"
  ln -sf "$nccl" "$here/shim/libnccl.so"
  dirs="$dirs${dirs:+:}$here/shim"
else
  echo "run.sh: libnccl.so.2 not found on this machine" >&2
fi
export LD_LIBRARY_PATH="$dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv 2>/dev/null || true
rc=0
"$here/cuda_gpu" --include-ignored --test-threads=1 || rc=1
"$here/cuda_gpu_model" --include-ignored --test-threads=1 || rc=1
"$here/cuda_ptx" --nocapture || rc=1
NCCL_SOCKET_IFNAME=lo NCCL_MULTI_RANK_GPU_ENABLE=1 DTENSOR_GPU_REQUIRED=1 \
  "$here/nccl" --include-ignored --test-threads=1 || rc=1
exit $rc
RUN
chmod +x "$out/run.sh"
ls -la "$out"
