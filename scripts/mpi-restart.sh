#!/usr/bin/env bash
# Training that survives a lost rank, by restart: `train_gpt --backend mpi` under
# `mpirun -np 4` (dp=2,tp=2 with SP, f32) saves a checkpoint every K steps; once the index
# holds a step >= K, one rank process (rank 2, found by pgrep on the binary and this run's
# unique save dir, its rank read from OMPI_COMM_WORLD_RANK) is killed with SIGKILL. The job
# must end (bounded by `timeout`: 124 is a hang) with a non-zero exit and a message naming
# the lost rank; then `--resume` under a fresh `mpirun -np 4` must finish, and every loss
# it prints, the last included, must be bitwise the loss of a run that never failed
# (the threads backend, which the MPI backend matches bit for bit: see mpi-tests.sh).
#
# Prints `ok: …` / `FAILED: …` lines and exits 1 if any failed. Called by mpi-tests.sh
# after it built train_gpt with `--features mpi`; runs alone the same way.
# Env: CARGO_TARGET_DIR (default target/), RESTART_STEPS (default 40), RESTART_EVERY (5).
set -euo pipefail
cd "$(dirname "$0")/.."

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export DTENSOR_TIMEOUT_SECS="${DTENSOR_TIMEOUT_SECS:-60}"
MPIRUN=(mpirun --oversubscribe --allow-run-as-root)
bin="${CARGO_TARGET_DIR:-target}/debug/examples/train_gpt"
steps="${RESTART_STEPS:-40}"
every="${RESTART_EVERY:-5}"
victim=2
train=(--mesh dp=2,tp=2 --sp --dtype f32 --steps "$steps" --print-loss-bits)

if [ ! -x "$bin" ]; then
  echo "mpi-restart: $bin not found: cargo build --profile test --features mpi --example train_gpt" >&2
  exit 1
fi

passed=0
failed=0
pass() { echo "ok: $1"; passed=$((passed + 1)); }
fail() { echo "FAILED: $1"; failed=$((failed + 1)); }

work=$(mktemp -d)
# A unique save dir: pgrep below matches this run's ranks and no one else's.
dir="$work/ckpt"
job=
cleanup() {
  if [ -n "$job" ] && kill -0 "$job" 2>/dev/null; then kill -9 "$job" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

saved_step() {
  grep -o '"data.step": *"[0-9]*"' "$dir/index.json" 2>/dev/null | grep -o '[0-9][0-9]*' || true
}

echo "== mpi restart: mpirun -np 4 train_gpt --save-every $every, kill -9 rank $victim after a checkpoint, --resume"
t0=$SECONDS
# The reference: a run that never failed.
ref_log="$work/ref.log"
timeout 300 "$bin" --backend threads "${train[@]}" >"$ref_log" 2>&1 || {
  cat "$ref_log"
  fail "restart: the reference threads run failed"
  echo "mpi restart: $passed passed, $failed failed"
  exit 1
}

# 1. The run that loses a rank.
log="$work/killed.log"
timeout 300 "${MPIRUN[@]}" -np 4 "$bin" --backend mpi "${train[@]}" \
  --save-every "$every" --save-dir "$dir" >"$log" 2>&1 &
job=$!
step=
for _ in $(seq 1 1200); do
  step=$(saved_step)
  if [ -n "$step" ] && [ "$step" -ge "$every" ]; then break; fi
  kill -0 "$job" 2>/dev/null || break
  sleep 0.1
done
pid=
if [ -n "$step" ] && [ "$step" -ge "$every" ]; then
  for p in $(pgrep -f "^$bin .*--save-dir $dir( |\$)" || true); do
    r=$(tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | sed -n 's/^OMPI_COMM_WORLD_RANK=//p')
    if [ "$r" = "$victim" ]; then pid=$p; fi
  done
fi
if [ -n "$pid" ]; then
  kill -9 "$pid"
  echo "killed rank $victim (pid $pid) after the checkpoint of step $step"
fi
set +e
wait "$job"
rc=$?
set -e
job=
killed_at=$(saved_step)
want="rank $victim .*exited on signal 9|rank $victim failed"
if [ -z "$pid" ]; then
  cat "$log"
  fail "restart: no rank $victim process to kill after a checkpoint of step >= $every (saved step '${step:-none}', the run ended with $rc)"
elif [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && grep -Eq "$want" "$log"; then
  grep -E "$want" "$log" | head -n 1
  pass "restart: killed rank $victim ended the job: exit $rc, message names the rank, last checkpoint at step $killed_at"
else
  cat "$log"
  fail "restart: after kill -9 of rank $victim: exit $rc (want non-zero, not the 124 of a hang), message /$want/"
fi

# 2. The restart from the last checkpoint.
res_log="$work/resumed.log"
set +e
timeout 300 "${MPIRUN[@]}" -np 4 "$bin" --backend mpi "${train[@]}" --resume "$dir" >"$res_log" 2>&1
rc=$?
set -e
bits() { grep -E '^step +[0-9]+  loss_bits=0x[0-9a-f]+$' "$1" | sed 's/  */ /g' || true; }
got=$(bits "$res_log")
n=$(printf '%s\n' "$got" | grep -c . || true)
# The reference's losses for the steps the resumed run ran (from the checkpoint's step).
want_bits=$(bits "$ref_log" | tail -n "$n")
want_n=$((steps - ${killed_at:-0}))
last_got=$(printf '%s\n' "$got" | tail -n 1)
last_want=$(bits "$ref_log" | tail -n 1)
if [ "$rc" -eq 0 ] && grep -q "resumed from $dir at step $killed_at" "$res_log" \
  && [ "$n" -eq "$want_n" ] && [ "$got" = "$want_bits" ] && [ "$last_got" = "$last_want" ]; then
  echo "final: $last_got"
  pass "restart: --resume at step $killed_at under a fresh mpirun -np 4 finished; its $n losses (final included) bitwise equal a run that never failed"
else
  cat "$res_log"
  diff <(echo "$want_bits") <(echo "$got") || true
  fail "restart: --resume (exit $rc, $n losses from step ${killed_at:-?}; want exit 0, $want_n losses equal to the never-failed run's, final $last_want)"
fi
echo "mpi restart: $passed passed, $failed failed ($((SECONDS - t0)) s)"
[ "$failed" -eq 0 ]
