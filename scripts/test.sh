#!/usr/bin/env bash
# README's test command: every test of the workspace on the threads backend, then the MPI
# backend's suite under mpirun (conformance on 2 and 4 ranks, failing ranks, train_gpt's
# losses bitwise equal to the threads backend's) when OpenMPI is installed. Without it the
# MPI suite says "skipped" and why (`.ci/run` installs OpenMPI, so CI always runs it).
set -euo pipefail
cd "$(dirname "$0")/.."

# The `cuda` and `nccl` features compile on any machine (cudarc loads CUDA and libnccl at run
# time), so the workspace is always tested with them: the GPU code is built, the kernels are
# compiled by NVRTC and assembled by ptxas when those tools are installed
# (`eval "$(bash scripts/cuda-tools.sh)"`), the NCCL backend's no-GPU tests check its errors
# without libnccl or a driver, and the tests that need a GPU are listed as ignored. With
# OpenMPI present the `mpi` feature joins them, so the MPI suite below reuses every artifact
# instead of rebuilding.
features=cuda,nccl
mpi=no
if command -v mpirun >/dev/null 2>&1 && command -v mpicc >/dev/null 2>&1; then
  features=cuda,nccl,mpi
  mpi=yes
fi
export DTENSOR_TEST_FEATURES="$features"
cargo test --workspace --features "$features"

# The bandwidth guard's judging logic, on canned bench_report outputs (no timing).
bash scripts/bench-guard-test.sh

# Each feature replaces a stand-in that a build without it carries: test those too.
cargo test -p dtensor-kernels --test cuda_stand_in
cargo test -p dtensor-collectives --test nccl_stand_in
if [ "$mpi" = yes ]; then
  cargo test -p dtensor-collectives --test mpi_stand_in
fi

if [ -z "${PTXAS:-}" ] || [ ! -x "${PTXAS:-}" ]; then
  echo "cuda: kernel compile check (kernels/tests/cuda_ptx.rs) skipped: NVRTC and ptxas not found (eval \"\$(bash scripts/cuda-tools.sh)\" installs them; .ci/run does)"
fi

if [ "$mpi" = yes ]; then
  bash scripts/mpi-tests.sh
else
  echo "mpi: skipped: OpenMPI is not installed (apt-get install openmpi-bin libopenmpi-dev libclang-dev clang pkg-config; .ci/run does)"
fi
