#!/usr/bin/env bash
# Checks scripts/bench-guard.sh's judgement on canned bench_report outputs (no timing, no
# build): the median decides, not the best run; A/B judges new against old; `chunk` and
# lines of more ranks than cores are shown but not judged; a baseline written from one
# output judges another as A/B does; bad usage exits 2.
set -euo pipefail
guard="$(cd "$(dirname "$0")" && pwd)/bench-guard.sh"
dir=$(mktemp -d "${TMPDIR:-/tmp}/bench-guard-test.XXXXXX")
trap 'rm -rf "$dir"' EXIT
failures=0
check() { # description, condition (a command)
    if "${@:2}"; then echo "ok: $1"; else echo "FAILED: $1"; failures=$((failures + 1)); fi
}

# One bench_report run: a collective line per (op, ranks) with the given ratio (memcpy 10 GB/s).
line() { # op ranks ratio
    local gbps
    gbps=$(awk -v r="$3" 'BEGIN { printf "%.2f", r * 10 }')
    echo "op=$1 ranks=$2 bytes=16777216 dtype=f32 time_us=100.0 algbw_GBps=$gbps busbw_GBps=$gbps memcpy_GBps=10.00 ratio=$3 backend=threads"
}
run() { # ratios of: steady, slow_median, one_bad_run, oversubscribed, chunk
    echo "bench_report: threads backend"
    line all_gather 2 "$1"
    line reduce_scatter 2 "$2"
    line all_reduce 2 "$3"
    line reduce_scatter 4 "$4"
    line chunk 2 "$5"
    echo "op=gemm shape=square dtype=f32 ours_GFLOPs=50.0 direct_GFLOPs=50.0 ratio=1.000"
}
for i in 1 2 3 4 5; do run 1.00 1.00 1.00 1.00 10.0; done >"$dir/old.txt"
{
    run 1.01 0.50 1.00 0.30 1.0
    run 0.99 0.50 0.20 0.30 1.0 # one bad run of all_reduce: its median stays 1.00
    run 1.00 0.50 1.00 0.30 1.0
    run 1.00 0.50 1.00 0.30 1.0
    run 1.00 1.20 1.00 0.30 1.0 # one good run of reduce_scatter: its best is 1.20, its median 0.50
} >"$dir/new.txt"

set +e
bash "$guard" --replay "$dir/new.txt" --replay-against "$dir/old.txt" --cores 2 >"$dir/ab.out" 2>&1
ab_rc=$?
set -e
cat "$dir/ab.out"
row() { grep -E "^$1 +$2 " "$dir/$3"; }
check "A/B exits 1 when a judged line lost more than 20%" test "$ab_rc" = 1
check "A/B flags exactly one line" test "$(grep -c 'LOST MORE THAN' "$dir/ab.out")" = 1
check "the median decides: reduce_scatter ranks=2 (median 0.50, best 1.20) is flagged" \
    grep -qE '^reduce_scatter +ranks=2 .*LOST MORE THAN 20%' "$dir/ab.out"
check "its best run is shown" grep -qE '^reduce_scatter +ranks=2 .* 0\.500 +1\.200 +1\.000 ' "$dir/ab.out"
check "one bad run does not flag all_reduce (median 1.00)" \
    bash -c "grep -E '^all_reduce +ranks=2 ' '$dir/ab.out' | grep -qv LOST"
check "4 ranks on 2 cores: shown, not judged" \
    grep -qE '^reduce_scatter +ranks=4 .*-70%  \(oversubscribed: not judged\)' "$dir/ab.out"
check "chunk: shown, not judged" grep -qE '^chunk .*\(a view: not judged\)' "$dir/ab.out"
check "gemm is judged and steady" grep -qE '^gemm +shape=square .* \+0%$' "$dir/ab.out"

set +e
bash "$guard" --replay "$dir/new.txt" --replay-against "$dir/old.txt" --cores 4 >"$dir/ab4.out" 2>&1
ab4_rc=$?
set -e
check "with 4 cores the 4-rank line is judged too" test "$(grep -c 'LOST MORE THAN' "$dir/ab4.out")" = 2
check "and the exit is still 1" test "$ab4_rc" = 1

bash "$guard" --replay "$dir/old.txt" --baseline-out "$dir/baseline.txt" --cores 2 >/dev/null
check "a written baseline holds each line's median" \
    grep -qx 'op=reduce_scatter ranks=2 bytes=16777216 dtype=f32 backend=threads ratio=1.0000' "$dir/baseline.txt"
set +e
bash "$guard" --replay "$dir/new.txt" --baseline "$dir/baseline.txt" --cores 2 >"$dir/base.out" 2>&1
base_rc=$?
set -e
check "against that baseline the same line is flagged" \
    test "$base_rc-$(grep -c 'LOST MORE THAN' "$dir/base.out")" = "1-1"

bash "$guard" --replay "$dir/old.txt" --replay-against "$dir/old.txt" --cores 2 >"$dir/same.out" 2>&1 &&
    same_rc=0 || same_rc=$?
check "a binary against itself: nothing flagged, exit 0" test "$same_rc" = 0

for bad in "--runs 0" "--threshold x" "--cores 0" "--replay-against $dir/old.txt" "--nonsense"; do
    set +e
    # shellcheck disable=SC2086 # the options are words
    bash "$guard" $bad >/dev/null 2>&1
    rc=$?
    set -e
    check "usage error ($bad) exits 2" test "$rc" = 2
done

if [ "$failures" -gt 0 ]; then
    echo "bench-guard-test: $failures check(s) failed"
    exit 1
fi
echo "bench-guard-test: all checks passed"
