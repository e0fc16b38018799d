#!/usr/bin/env bash
# The CPU matmul on CPUs without AVX-512. gemm is built with its `x86-v4` feature: it carries
# AVX-512 kernels beside the AVX2/FMA and SSE ones and picks one at run time from what the CPU
# reports. This runs the matmul tests (kernels/tests/ops_matmul.rs, against a naive
# reference) under QEMU's user-mode emulator on CPU models that lack AVX-512, so the run-time
# choice is exercised on them: `Haswell` (AVX2 + FMA) and `qemu64` (SSE2 only). Any machine
# with AVX-512 runs the same tests natively in the workspace's test run.
#
# usage: scripts/no-avx512.sh   (installs qemu-user through apt-get when missing)
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v qemu-x86_64 >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq qemu-user
fi

# The test binary's path, from cargo's own report of what it built.
bin=$(cargo test -p dtensor-kernels --test ops_matmul --no-run --message-format=json 2>/dev/null \
  | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n 1)
if [ -z "$bin" ] || [ ! -x "$bin" ]; then
  echo "no-avx512: FAILED: could not build kernels/tests/ops_matmul.rs" >&2
  exit 1
fi

status=0
for cpu in Haswell qemu64; do
  echo "== no-avx512: the matmul tests on an emulated $cpu CPU"
  # --include-ignored: the one ignored test asserts that the emulated CPU lacks AVX-512.
  if ! out=$(timeout 600 qemu-x86_64 -cpu "$cpu" "$bin" --include-ignored 2>&1); then
    echo "$out" | tail -n 20
    echo "no-avx512: FAILED on $cpu"
    status=1
    continue
  fi
  echo "$out" | grep "test result"
done
exit $status
