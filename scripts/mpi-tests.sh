#!/usr/bin/env bash
# The MPI backend's checks: builds dtensor-collectives with `--features mpi`, runs the
# conformance suite (collectives/examples/mpi_conformance.rs) under
# `mpirun --oversubscribe -np 2` and `-np 4`, and checks that a failing rank ends the whole
# job with a message naming it and a non-zero exit code (collectives/examples/mpi_fail.rs).
#
# Needs OpenMPI (openmpi-bin, libopenmpi-dev) and libclang (for rsmpi's bindings); `.ci/run`
# installs them. Without mpirun it says so and exits 1 (never a silent pass).
# Env: CARGO_TARGET_DIR (default target/), NP_LIST (default "2 4").
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v mpirun >/dev/null 2>&1; then
  echo "mpi-tests: mpirun not found: install OpenMPI (apt-get install openmpi-bin libopenmpi-dev libclang-dev)" >&2
  exit 1
fi

# OpenMPI refuses to run as root unless told it may (CI runs as root).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Keep a rank that never arrives from stalling the run.
export DTENSOR_TIMEOUT_SECS="${DTENSOR_TIMEOUT_SECS:-60}"
MPIRUN=(mpirun --oversubscribe --allow-run-as-root)
target="${CARGO_TARGET_DIR:-target}"
bin="$target/debug/examples"

echo "== mpi: build (--features mpi)"
# The test profile (output in debug/) reuses what README's `cargo test --workspace` built.
cargo build --profile test -p dtensor-collectives --features mpi --examples

passed=0
failed=0
pass() { echo "ok: $1"; passed=$((passed + 1)); }
fail() { echo "FAILED: $1"; failed=$((failed + 1)); }

for np in ${NP_LIST:-2 4}; do
  echo "== mpi: conformance, mpirun -np $np"
  log=$(mktemp)
  if timeout 600 "${MPIRUN[@]}" -np "$np" "$bin/mpi_conformance" >"$log" 2>&1 \
    && tail -n 1 "$log" | grep -Eq '^[0-9]+ passed, 0 failed$'; then
    grep -v ' \.\.\. ok$' "$log" || true
    pass "conformance -np $np"
  else
    cat "$log"
    fail "conformance -np $np"
  fi
  rm -f "$log"
done

# mode, expected message (grep -E)
cases=(
  "error|rank 1 failed: returned an error: .*failing on purpose"
  "panic|rank 1 failed: panicked: panicking on purpose"
  "early|rank 0 failed: returned an error: rank 1 failed \(returned before joining\)"
  "absent|rank 0 failed: returned an error: all_reduce timed out after .* waiting for ranks \[1\]"
)
for c in "${cases[@]}"; do
  mode="${c%%|*}"
  want="${c#*|}"
  echo "== mpi: failing rank ($mode), mpirun -np 2"
  log=$(mktemp)
  set +e
  DTENSOR_TIMEOUT_SECS=5 timeout 120 "${MPIRUN[@]}" -np 2 "$bin/mpi_fail" "$mode" >"$log" 2>&1
  rc=$?
  set -e
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && grep -Eq "$want" "$log"; then
    pass "failing rank ($mode): exit $rc, message found"
  else
    cat "$log"
    fail "failing rank ($mode): exit $rc (want non-zero, not the 124 of a hang), message /$want/"
  fi
  rm -f "$log"
done

echo "mpi: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
