#!/usr/bin/env bash
# README's test command: every test of the workspace on the threads backend, then the MPI
# backend's suite under mpirun (conformance on 2 and 4 ranks, failing ranks, train_gpt's
# losses bitwise equal to the threads backend's) when OpenMPI is installed. Without it the
# MPI suite says "skipped" and why (`.ci/run` installs OpenMPI, so CI always runs it).
set -euo pipefail
cd "$(dirname "$0")/.."

if command -v mpirun >/dev/null 2>&1 && command -v mpicc >/dev/null 2>&1; then
  # With OpenMPI present the workspace is built once with the `mpi` feature, so the MPI
  # suite below reuses every artifact instead of rebuilding the crates above collectives.
  cargo test --workspace --features mpi
  # The feature replaces the stand-in that a build without it carries: test that one too.
  cargo test -p dtensor-collectives --test mpi_stand_in
  bash scripts/mpi-tests.sh
else
  cargo test --workspace
  echo "mpi: skipped: OpenMPI is not installed (apt-get install openmpi-bin libopenmpi-dev libclang-dev clang pkg-config; .ci/run does)"
fi
