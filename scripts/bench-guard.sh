#!/usr/bin/env bash
# The bandwidth guard: runs `bench_report` (threads backend) a few times, takes each line's
# best ratio (a collective's GB/s over one thread's memcpy GB/s of the same run; a gemm
# line's, ours over the gemm crate's), and compares it with the committed baseline
# (benches/baseline/bench_report.txt). A line that lost more than 20% of its baseline
# ratio is flagged and the script exits 1 (`chunk`, a view on the threads backend, is shown
# but not judged). Ratios, not GB/s: memcpy measured in the same
# run carries most of a machine's (and a busy machine's) speed out of the comparison.
#
# Run it before resolving an issue that touches collectives or kernels, on a quiet machine
# (nothing else compiling or running), and put its table in the issue note. It is not part
# of CI's tests: timings on shared CI machines are noise.
#
# usage: scripts/bench-guard.sh [options] [-- bench_report args]
#   --bin PATH          measure this bench_report binary (default: build this checkout's)
#   --commit REV        build and measure bench_report of commit REV (a temporary git
#                       worktree; its build goes to $CARGO_TARGET_DIR/bench-guard)
#   --runs N            runs of bench_report; each line keeps its best ratio (default 3)
#   --baseline FILE     the baseline to compare with (default benches/baseline/bench_report.txt)
#   --baseline-out FILE write the best ratios of these runs as a baseline to FILE (no
#                       comparison; commit it to make it the reference)
#   --threshold PCT     flag a line whose ratio fell more than PCT percent (default 20)
#   -- ARGS             passed to bench_report, e.g. `-- --sizes 1M --no-gemm` for a quick
#                       check that the guard itself works (a binary built before
#                       `--sizes` existed takes only `--quick`)
#
# Exit: 0 nothing flagged (or a baseline written), 1 a line flagged, 2 usage, no
# baseline, or bench_report failed.
# Env: CARGO_TARGET_DIR (default target/).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
tree="" out=""
cleanup() {
    [ -z "$out" ] || rm -f "$out"
    if [ -n "$tree" ]; then
        git -C "$root" worktree remove --force "$tree" >/dev/null 2>&1 || rm -rf "$tree"
    fi
}
trap cleanup EXIT
bin="" commit="" runs=3 threshold=20
baseline="$root/benches/baseline/bench_report.txt" baseline_out=""
bench_args=()
usage() { sed -n '/^# usage:/,/^# Env:/s/^# \{0,1\}//p' "$0"; }
while [ $# -gt 0 ]; do
    case "$1" in
        --bin) bin=${2:?--bin needs a path}; shift 2 ;;
        --commit) commit=${2:?--commit needs a revision}; shift 2 ;;
        --runs) runs=${2:?--runs needs a number}; shift 2 ;;
        --baseline) baseline=${2:?--baseline needs a file}; shift 2 ;;
        --baseline-out) baseline_out=${2:?--baseline-out needs a file}; shift 2 ;;
        --threshold) threshold=${2:?--threshold needs a percentage}; shift 2 ;;
        --) shift; bench_args=("$@"); break ;;
        -h|--help) usage; exit 0 ;;
        *) echo "bench-guard: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
done
case "$runs" in ''|*[!0-9]*|0) echo "bench-guard: --runs takes a whole number > 0" >&2; exit 2 ;; esac
case "$threshold" in ''|*[!0-9.]*) echo "bench-guard: --threshold takes a percentage" >&2; exit 2 ;; esac
if [ -n "$bin" ] && [ -n "$commit" ]; then
    echo "bench-guard: --bin and --commit exclude each other" >&2; exit 2
fi
if [ -z "$baseline_out" ] && [ ! -f "$baseline" ]; then
    echo "bench-guard: no baseline at $baseline: measure a reference build with" >&2
    echo "  scripts/bench-guard.sh --commit REV --baseline-out $baseline" >&2
    echo "on a quiet machine and commit it" >&2
    exit 2
fi

target=${CARGO_TARGET_DIR:-$root/target}
case "$target" in /*) ;; *) target="$root/$target" ;; esac
measured="this checkout ($(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$root" diff --quiet HEAD 2>/dev/null || echo ', with uncommitted changes'))"
if [ -n "$commit" ]; then
    rev=$(git -C "$root" rev-parse --short "$commit^{commit}") || exit 2
    tree=$(mktemp -d "${TMPDIR:-/tmp}/bench-guard.XXXXXX")
    git -C "$root" worktree add --force --detach "$tree" "$rev" >/dev/null
    echo "bench-guard: building bench_report of $rev" >&2
    (cd "$tree" && CARGO_TARGET_DIR="$target/bench-guard" cargo build --release --example bench_report) >&2
    bin="$target/bench-guard/release/examples/bench_report"
    measured="commit $rev"
elif [ -z "$bin" ]; then
    echo "bench-guard: building bench_report" >&2
    (cd "$root" && CARGO_TARGET_DIR="$target" cargo build --release --example bench_report) >&2
    bin="$target/release/examples/bench_report"
else
    measured="$bin"
fi
[ -x "$bin" ] || { echo "bench-guard: $bin is not an executable" >&2; exit 2; }

out=$(mktemp "${TMPDIR:-/tmp}/bench-guard-out.XXXXXX")
for i in $(seq 1 "$runs"); do
    echo "bench-guard: run $i of $runs: $bin ${bench_args[*]:-}" >&2
    if ! "$bin" "${bench_args[@]}" >>"$out"; then
        echo "bench-guard: bench_report failed (run $i)" >&2
        exit 2
    fi
done

# Each line's key is every field but the measured ones; the best ratio over the runs wins,
# with the GB/s (or GFLOP/s) of that run.
best=$(awk '
    /^op=/ {
        key = ""; ratio = ""; speed = ""; memcpy = ""
        for (i = 1; i <= NF; i++) {
            split($i, kv, "=")
            if (kv[1] == "ratio") ratio = kv[2]
            else if (kv[1] == "memcpy_GBps") memcpy = kv[2]
            else if (kv[1] == "algbw_GBps" || kv[1] == "GBps" || kv[1] == "ours_GFLOPs") speed = kv[2]
            else if (kv[1] !~ /^(time_us|busbw_GBps|direct_GFLOPs)$/) key = key (key == "" ? "" : " ") $i
        }
        if (ratio == "") next
        # The printed ratio has two decimals; the two bandwidths give it more.
        if (speed != "" && memcpy + 0 > 0) ratio = sprintf("%.4f", speed / memcpy)
        if (!(key in r) || ratio + 0 > r[key] + 0) { r[key] = ratio; s[key] = speed }
        if (!(key in order)) { order[key] = ++n; keys[n] = key }
    }
    END { for (i = 1; i <= n; i++) print keys[i] "\t" r[keys[i]] "\t" s[keys[i]] }
' "$out")
if [ -z "$best" ]; then
    echo "bench-guard: bench_report printed no line with a ratio" >&2
    exit 2
fi

if [ -n "$baseline_out" ]; then
    mkdir -p "$(dirname "$baseline_out")"
    {
        echo "# bench_report ratios (best of $runs runs), written by scripts/bench-guard.sh --baseline-out"
        echo "# measured: $measured; $(date -u +%Y-%m-%dT%H:%MZ); $(uname -m), $(nproc 2>/dev/null || echo '?') cores, $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo 2>/dev/null | head -1)"
        echo "# bench_report args: ${bench_args[*]:-(none)}"
        printf '%s\n' "$best" | awk -F'\t' '{ print $1 " ratio=" $2 }'
    } >"$baseline_out"
    echo "bench-guard: wrote $(printf '%s\n' "$best" | wc -l) baseline ratios of $measured to $baseline_out"
    printf '%s\n' "$best" | awk -F'\t' '{ printf "%-62s %8s  ratio %6s\n", $1, $3, $2 }'
    exit 0
fi

echo "bench-guard: $measured, best of $runs runs, against $baseline (flag: ratio down more than $threshold%)"
echo "speed: algbw GB/s (memcpy_parallel: GB/s; gemm: our GFLOP/s); ratio: over memcpy GB/s of the same run (gemm: the gemm crate's time over ours)"
printf '%s\n' "$best" | awk -F'\t' -v base="$baseline" -v thr="$threshold" '
    BEGIN {
        while ((getline line < base) > 0) {
            if (line ~ /^#/ || line !~ /ratio=/) continue
            i = index(line, " ratio=")
            b[substr(line, 1, i - 1)] = substr(line, i + 7) + 0
        }
        printf "%-16s %-28s %6s %10s %8s %8s %8s\n", "op", "case", "size", "speed", "ratio", "baseline", "change"
    }
    function size(bytes) {
        if (bytes == "") return "-"
        if (bytes % 1048576 == 0) return (bytes / 1048576) "M"
        if (bytes % 1024 == 0) return (bytes / 1024) "K"
        return bytes
    }
    {
        key = $1; ratio = $2 + 0; n = split(key, f, " "); op = ""; rest = ""; bytes = ""
        for (i = 1; i <= n; i++) {
            split(f[i], kv, "=")
            if (kv[1] == "op") op = kv[2]
            else if (kv[1] == "bytes") bytes = kv[2]
            else if (kv[1] != "backend") rest = rest (rest == "" ? "" : " ") f[i]
        }
        if (key in b) {
            change = b[key] > 0 ? (ratio / b[key] - 1) * 100 : 0
            # `chunk` on the threads backend is a view (no bytes move): its few-microsecond
            # times are timer noise, so it is shown but never judged.
            if (op == "chunk") mark = "  (a view: not judged)"
            else {
                mark = change < -thr ? "  LOST MORE THAN " thr "%" : ""
                if (mark != "") flagged++
            }
            printf "%-16s %-28s %6s %10s %8.3f %8.3f %+7.0f%%%s\n", op, rest, size(bytes), $3, ratio, b[key], change, mark
            seen[key] = 1
        } else {
            printf "%-16s %-28s %6s %10s %8.3f %8s %8s\n", op, rest, size(bytes), $3, ratio, "-", "new"
        }
    }
    END {
        missing = 0
        for (k in b) if (!(k in seen)) missing++
        if (missing) printf "%d baseline line(s) not measured in this run (other sizes or backends)\n", missing
        if (flagged) { printf "bench-guard: %d line(s) lost more than %s%% of their baseline ratio\n", flagged, thr; exit 1 }
        print "bench-guard: no line lost more than " thr "% of its baseline ratio"
    }
'
