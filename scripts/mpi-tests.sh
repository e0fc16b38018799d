#!/usr/bin/env bash
# The MPI backend's checks: builds dtensor-collectives with `--features mpi`, runs the
# backend conformance suite (collectives/src/conformance.rs, the cases the threads backend
# runs in collectives/tests/threads.rs, driven by collectives/examples/mpi_conformance.rs)
# under `mpirun --oversubscribe -np 2` and `-np 4` (its last line must say some passed and
# `0 failed`; the skipped cases, for a group too small, and the unsupported ones (none on
# MPI today), are printed and never counted as passed), and checks that a
# failing rank ends the whole job with a message naming it and a non-zero exit code, with
# blocking and with asynchronous collectives (collectives/examples/mpi_fail.rs),
# and that misuse ends in an error (or an abort), not a hang or a call into a finalized
# MPI: a rank arriving after its peers timed out, the same with the race forced in which
# it passes the agreement, handles used after `Mpi::finalize`
# (collectives/examples/mpi_misuse.rs).
# Then the facade's examples built with `--features mpi`: `train_gpt --backend mpi` under
# `mpirun -np 4` must print bitwise the same 20 losses as the threads backend (dp=2,tp=2
# with SP, pp=2,dp=2 with FSDP and 1F1B, cp=2,tp=2 with ring and all-to-all attention,
# ep=2,dp=2 with MoE blocks); checkpoints under MPI (save every 3 steps, resume in a
# second mpirun: the losses bitwise the threads run's, with TP + SP and with MoE and its
# expert selection bias); a rank killed with SIGKILL after a checkpoint ends the job with
# a message naming it, and a restart from the checkpoint ends with the never-failed run's
# final loss (scripts/mpi-restart.sh)
# (and say how
# to launch it when started without mpirun), `train_gpt --backend mpi --device cuda` (a
# build with `--features mpi,cuda,nccl`) without a GPU ends both ranks with the named "no
# CUDA driver" error and a non-zero exit, within a timeout, and `bench_report --backend mpi --quick` under
# `mpirun -np 2` must print a `backend=mpi` line for every redistribution op.
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
# Built over the whole workspace (not `-p dtensor-collectives`) with the features that
# scripts/test.sh tested it with, so the features unify as they did there and nothing is
# compiled twice.
cargo build --profile test --workspace --features "${DTENSOR_TEST_FEATURES:-mpi}" --examples

passed=0
failed=0
pass() { echo "ok: $1"; passed=$((passed + 1)); }
fail() { echo "FAILED: $1"; failed=$((failed + 1)); }

for np in ${NP_LIST:-2 4}; do
  echo "== mpi: conformance, mpirun -np $np"
  log=$(mktemp)
  if timeout 600 "${MPIRUN[@]}" -np "$np" "$bin/mpi_conformance" >"$log" 2>&1 \
    && tail -n 1 "$log" | grep -Eq '^[1-9][0-9]* passed, 0 failed, [0-9]+ skipped, [0-9]+ unsupported$'; then
    grep -v ' \.\.\. ok$' "$log" || true
    pass "conformance -np $np"
  else
    cat "$log"
    fail "conformance -np $np"
  fi
  rm -f "$log"
done

# mode, expected message (grep -E). A rank that returns early is named either by its peer
# (rank 0 sees it leave) or by itself (its finalize finds rank 0 still in a collective with
# it and aborts the job): which one prints first is the scheduler's choice.
early="rank 0 failed: returned an error: rank 1 failed \(returned before joining\)|rank 1 failed: finalize: .*ranks \[0\] were still in collectives with it"
cases=(
  "error|rank 1 failed: returned an error: .*failing on purpose"
  "panic|rank 1 failed: panicked: panicking on purpose"
  "early|$early"
  "absent|rank 0 failed: returned an error: all_reduce timed out after .* waiting for ranks \[1\]"
  "async-error|rank 1 failed: returned an error: .*failing on purpose"
  "async-panic|rank 1 failed: panicked: panicking on purpose"
  "async-early|$early"
  "async-absent|rank 0 failed: returned an error: all_reduce timed out after .* waiting for ranks \[1\]"
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

# Misuse (mpi_misuse.rs sets its own 0.5 s timeout): mode, ranks, PASS lines expected.
# `late`: every rank must get an error from every collective (the late one at once, not
# `Ok` or a hang) and MPI must still finalize cleanly; `finalized`: every call on a handle
# kept past `Mpi::finalize` must return `Error::Finalized` (each rank prints a verdict).
misuse_cases=("late 2 1" "late 3 1" "finalized 2 2")
for c in "${misuse_cases[@]}"; do
  read -r mode np want <<<"$c"
  echo "== mpi: misuse ($mode), mpirun -np $np"
  log=$(mktemp)
  set +e
  timeout 60 "${MPIRUN[@]}" -np "$np" "$bin/mpi_misuse" "$mode" >"$log" 2>&1
  rc=$?
  set -e
  n_pass=$(grep -c "^misuse $mode.*: PASS\$" "$log" || true)
  if [ "$rc" -eq 0 ] && [ "$n_pass" -eq "$want" ]; then
    pass "misuse ($mode) -np $np: $n_pass PASS line(s), exit 0"
  else
    cat "$log"
    fail "misuse ($mode) -np $np: exit $rc (124: a hang), $n_pass PASS line(s) (want exit 0, $want)"
  fi
  rm -f "$log"
done

# The race a late rank can still hit (a peer times out as it completes the agreement),
# forced by a debug-build switch: the data phase must end in an abort naming the op and
# the rank that gave up, about one timeout later, not a hang.
echo "== mpi: misuse (stall), mpirun -np 2"
log=$(mktemp)
set +e
DTENSOR_MPI_TEST_IGNORE_WITHDRAWALS=1 timeout 60 "${MPIRUN[@]}" -np 2 "$bin/mpi_misuse" stall >"$log" 2>&1
rc=$?
set -e
want='rank 1 failed: all_reduce: the data phase did not finish within the timeout .*ranks \[0\] gave up'
if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && grep -Eq "$want" "$log" && ! grep -q 'misuse stall: FAIL' "$log"; then
  grep -E "$want" "$log"
  pass "misuse (stall) -np 2: exit $rc, abort message found"
else
  cat "$log"
  fail "misuse (stall) -np 2: exit $rc (want non-zero, not the 124 of a hang), message /$want/"
fi
rm -f "$log"

# train_gpt: the threads backend and 4 MPI processes must agree bit for bit, with TP + SP,
# with pipeline stages over data parallelism (FSDP, 1F1B, 4 microbatches), and with
# context parallelism over TP (ring attention with SP, all-to-all attention without), and
# with MoE blocks whose experts are sharded over ep (all-to-all-v dispatch and combine).
train_cases=(
  "--mesh dp=2,tp=2 --sp --steps 20 --print-loss-bits"
  "--mesh pp=2,dp=2 --fsdp --schedule 1f1b --microbatches 4 --layers 2 --steps 20 --print-loss-bits"
  "--mesh cp=2,tp=2 --sp --cp-impl ring --steps 20 --print-loss-bits"
  "--mesh cp=2,tp=2 --cp-impl a2a --steps 20 --print-loss-bits"
  "--moe --experts 4 --top-k 2 --mesh ep=2,dp=2 --steps 20 --print-loss-bits"
)
for spec in "${train_cases[@]}"; do
  read -r -a train <<<"$spec"
  echo "== mpi: train_gpt --backend threads vs mpirun -np 4 --backend mpi, ${train[*]}"
  thr_log=$(mktemp)
  mpi_log=$(mktemp)
  set +e
  timeout 600 "$bin/train_gpt" --backend threads "${train[@]}" >"$thr_log" 2>&1
  thr_rc=$?
  timeout 600 "${MPIRUN[@]}" -np 4 "$bin/train_gpt" --backend mpi "${train[@]}" >"$mpi_log" 2>&1
  mpi_rc=$?
  set -e
  thr_bits=$(grep -o 'loss_bits=0x[0-9a-f]*' "$thr_log" || true)
  mpi_bits=$(grep -o 'loss_bits=0x[0-9a-f]*' "$mpi_log" || true)
  n_bits=$(printf '%s\n' "$mpi_bits" | grep -c . || true)
  if [ "$thr_rc" -eq 0 ] && [ "$mpi_rc" -eq 0 ] && [ "$n_bits" -eq 20 ] && [ "$thr_bits" = "$mpi_bits" ]; then
    grep -v 'loss_bits=' "$mpi_log" || true
    pass "train_gpt ${train[*]}: 20 losses bitwise equal, threads vs mpi -np 4"
  else
    echo "-- threads (exit $thr_rc):"
    cat "$thr_log"
    echo "-- mpi (exit $mpi_rc):"
    cat "$mpi_log"
    diff <(echo "$thr_bits") <(echo "$mpi_bits") || true
    fail "train_gpt ${train[*]}: threads vs mpi -np 4 (exits $thr_rc / $mpi_rc, $n_bits mpi losses; want 0 / 0, 20 equal)"
  fi
  rm -f "$thr_log" "$mpi_log"
done

# Checkpoints on MPI: `mpirun -np 4` trains 6 of 12 steps saving every 3 (per-rank shard
# files, the index by rank 0), a second `mpirun -np 4` resumes from the last save and
# finishes; both runs' losses together must be bitwise the threads run's 12. The MoE case
# also checks the expert selection bias (layer state, not a parameter) is saved and loaded.
resume_cases=(
  "--mesh dp=2,tp=2 --sp --print-loss-bits"
  "--moe --experts 4 --top-k 2 --expert-bias 0.05 --mesh ep=2,dp=2 --print-loss-bits"
)
for spec in "${resume_cases[@]}"; do
  read -r -a train <<<"$spec"
  echo "== mpi: train_gpt --backend mpi -np 4 --save-every 3 to step 6, then --resume to step 12, ${train[*]}"
  t0=$SECONDS
  ck=$(mktemp -d)
  thr_log=$(mktemp)
  mpi_log=$(mktemp)
  set +e
  timeout 600 "$bin/train_gpt" --backend threads "${train[@]}" --steps 12 >"$thr_log" 2>&1
  thr_rc=$?
  # A save dir that does not exist yet: rank 0 creates it, the other processes wait.
  timeout 600 "${MPIRUN[@]}" -np 4 "$bin/train_gpt" --backend mpi "${train[@]}" --steps 6 \
    --save-every 3 --save-dir "$ck/run" >"$mpi_log" 2>&1
  save_rc=$?
  timeout 600 "${MPIRUN[@]}" -np 4 "$bin/train_gpt" --backend mpi "${train[@]}" --steps 12 \
    --resume "$ck/run" >>"$mpi_log" 2>&1
  res_rc=$?
  set -e
  thr_bits=$(grep -E '^step +[0-9]+  loss_bits=' "$thr_log" || true)
  mpi_bits=$(grep -E '^step +[0-9]+  loss_bits=' "$mpi_log" || true)
  n_bits=$(printf '%s\n' "$mpi_bits" | grep -c . || true)
  if [ "$thr_rc" -eq 0 ] && [ "$save_rc" -eq 0 ] && [ "$res_rc" -eq 0 ] && [ "$n_bits" -eq 12 ] \
    && [ "$thr_bits" = "$mpi_bits" ] && grep -q "resumed from $ck/run at step 6" "$mpi_log"; then
    grep -E 'saved|resumed' "$mpi_log" || true
    pass "train_gpt ${train[*]}: mpi -np 4 saved at step 6 and resumed: 12 losses bitwise equal to threads ($((SECONDS - t0)) s)"
  else
    echo "-- threads (exit $thr_rc):"
    cat "$thr_log"
    echo "-- mpi (exits $save_rc, $res_rc):"
    cat "$mpi_log"
    diff <(echo "$thr_bits") <(echo "$mpi_bits") || true
    fail "train_gpt ${train[*]}: mpi save + resume (exits $thr_rc / $save_rc / $res_rc, $n_bits mpi losses; want 0 / 0 / 0, 12 equal to threads)"
  fi
  rm -rf "$ck" "$thr_log" "$mpi_log"
done

# A rank lost mid-run (kill -9): the job ends naming it, and a restart from the last
# checkpoint finishes with the losses of a run that never failed (scripts/mpi-restart.sh).
set +e
bash scripts/mpi-restart.sh
rc=$?
set -e
if [ "$rc" -eq 0 ]; then
  pass "restart after a lost rank (scripts/mpi-restart.sh)"
else
  fail "restart after a lost rank (scripts/mpi-restart.sh): exit $rc"
fi

# name, expected message (grep -E), command...
launch_cases=(
  "train_gpt --backend mpi without mpirun|needs 4 ranks but this process was not started by mpirun.*mpirun -np N|$bin/train_gpt --backend mpi --mesh dp=2,tp=2 --sp --steps 20"
  "train_gpt --backend mpi on a world of the wrong size|mesh dp=2,tp=2 needs 4 ranks but mpirun started 2|${MPIRUN[*]} -np 2 $bin/train_gpt --backend mpi --mesh dp=2,tp=2 --steps 2"
  "bench_report --backend mpi without mpirun|not started by mpirun.*mpirun -np N|$bin/bench_report --backend mpi --quick"
)
for c in "${launch_cases[@]}"; do
  name="${c%%|*}"
  rest="${c#*|}"
  want="${rest%%|*}"
  cmd="${rest#*|}"
  echo "== mpi: $name"
  log=$(mktemp)
  set +e
  # Started from the script, not by mpirun: no launcher variables may leak in.
  # shellcheck disable=SC2086
  env -u OMPI_COMM_WORLD_SIZE -u PMI_SIZE -u PMI_RANK -u PMIX_RANK -u MPI_LOCALNRANKS \
    timeout 120 $cmd >"$log" 2>&1
  rc=$?
  set -e
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && grep -Eq "$want" "$log"; then
    grep -E "$want" "$log"
    pass "$name: exit $rc, message found"
  else
    cat "$log"
    fail "$name: exit $rc (want non-zero, not the 124 of a hang), message /$want/"
  fi
  rm -f "$log"
done

# train_gpt --backend mpi --device cuda on a machine without a GPU: every process checks
# its driver before any collective and the ranks share their verdicts, so both ranks must
# print the named "no CUDA driver" error and the job exit non-zero, within the timeout
# (not the 124 of a hang). Needs a build with the device features (CI's test.sh builds
# with them; otherwise train_gpt is rebuilt with them here).
echo "== mpi: train_gpt --backend mpi --device cuda without a GPU, mpirun -np 2"
if ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1'; then
  echo "mpi: train_gpt --device cuda without a GPU: skipped: a CUDA driver (libcuda.so.1) is installed here, and this check is for machines without one (not counted as passed)"
else
  case ",${DTENSOR_TEST_FEATURES:-mpi}," in
    *,nccl,*) ;;
    *) cargo build --profile test --features mpi,cuda,nccl --example train_gpt ;;
  esac
  log=$(mktemp)
  set +e
  timeout 120 "${MPIRUN[@]}" -np 2 "$bin/train_gpt" --backend mpi --device cuda --mesh dp=2 \
    --steps 1 >"$log" 2>&1
  rc=$?
  set -e
  missing=()
  for r in 0 1; do
    grep -Eq "^error: rank $r: --device cuda: no CUDA driver found" "$log" || missing+=("rank $r")
  done
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && [ "${#missing[@]}" -eq 0 ] && ! grep -q panicked "$log"; then
    grep -E "no CUDA driver found" "$log"
    pass "train_gpt --backend mpi --device cuda without a GPU: exit $rc, both ranks name the missing driver"
  else
    cat "$log"
    fail "train_gpt --backend mpi --device cuda without a GPU: exit $rc (want non-zero, not the 124 of a hang), no 'no CUDA driver found' error from: ${missing[*]:-none}"
  fi
  rm -f "$log"
fi

# bench_report: a smoke test (not a performance test): every op prints a backend=mpi line.
echo "== mpi: bench_report --backend mpi --quick, mpirun -np 2"
log=$(mktemp)
set +e
timeout 600 "${MPIRUN[@]}" -np 2 "$bin/bench_report" --backend mpi --quick >"$log" 2>&1
rc=$?
set -e
missing=()
for op in all_gather all_gather_last reduce_scatter all_reduce all_to_all chunk; do
  grep -Eq "^op=$op ranks=2 bytes=[0-9]+ dtype=[a-z0-9]+ time_us=.* backend=mpi\$" "$log" || missing+=("$op")
done
if [ "$rc" -eq 0 ] && [ "${#missing[@]}" -eq 0 ]; then
  cat "$log"
  pass "bench_report --backend mpi -np 2: backend=mpi lines for every op"
else
  cat "$log"
  fail "bench_report --backend mpi -np 2: exit $rc, ops without a backend=mpi line: ${missing[*]:-none}"
fi
rm -f "$log"

echo "mpi: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
