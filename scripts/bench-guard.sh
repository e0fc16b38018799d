#!/usr/bin/env bash
# The bandwidth guard: runs `bench_report` (threads backend) several times and judges each
# line's ratio (a collective's GB/s over one thread's memcpy GB/s of the same run; a gemm
# line's, the gemm crate's time over ours) by its **median** over the runs (the best is
# shown beside it). A line whose median ratio fell more than the threshold (20%) is flagged
# and the script exits 1. Ratios, not GB/s: memcpy measured in the same run carries most
# of a machine's (and a busy machine's) speed out of the comparison.
#
# Two ways to judge:
# - against the committed baseline (benches/baseline/bench_report.txt), the default;
# - A/B (`--against BIN|REV`): the reference binary and the measured one run interleaved
#   (old, new, old, new, …) in the same minutes, and each line is judged by
#   median(new) / median(old). Use this on a machine whose speed drifts between hours (a
#   shared one): both binaries see the same drift.
#
# Not judged, only shown: `chunk` (a view on the threads backend: its few-microsecond
# times are timer noise), and every line with more ranks (or memcpy threads) than the
# machine has cores (`nproc`): oversubscribed ranks time the scheduler, not our code.
#
# Run it before resolving an issue that touches collectives or kernels, on a quiet machine
# (nothing else compiling or running), and put its table in the issue note. It is not part
# of CI's tests: timings on shared CI machines are noise. scripts/bench-guard-test.sh checks
# its arithmetic on canned outputs (no timing).
#
# usage: scripts/bench-guard.sh [options] [-- bench_report args]
#   --bin PATH          measure this bench_report binary (default: build this checkout's)
#   --commit REV        build and measure bench_report of commit REV (a temporary git
#                       worktree; its build goes to $CARGO_TARGET_DIR/bench-guard)
#   --against BIN|REV   A/B: judge against this reference (an executable bench_report, or
#                       a commit built as --commit does), run interleaved with the
#                       measured binary, instead of against the baseline
#   --runs N            runs of bench_report (of each binary in A/B); each line is judged
#                       by its median (default 5)
#   --baseline FILE     the baseline to compare with (default benches/baseline/bench_report.txt)
#   --baseline-out FILE write the median ratios of these runs as a baseline to FILE (no
#                       comparison; commit it to make it the reference)
#   --threshold PCT     flag a line whose median ratio fell more than PCT percent (default 20)
#   --cores N           judge lines of at most N ranks (default: nproc)
#   --replay FILE       judge the bench_report output in FILE (any number of runs, one after
#                       another) instead of running bench_report
#   --replay-against FILE   A/B on canned outputs: FILE is the reference's output
#   -- ARGS             passed to bench_report, e.g. `-- --sizes 1M --no-gemm` for a quick
#                       check that the guard itself works (a binary built before
#                       `--sizes` existed takes only `--quick`)
#
# Exit: 0 nothing flagged (or a baseline written), 1 a line flagged, 2 usage, no
# baseline, or bench_report failed.
# Env: CARGO_TARGET_DIR (default target/).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
trees=() scratch=""
cleanup() {
    [ -z "$scratch" ] || rm -rf "$scratch"
    local t
    for t in ${trees[@]+"${trees[@]}"}; do
        git -C "$root" worktree remove --force "$t" >/dev/null 2>&1 || rm -rf "$t"
    done
}
trap cleanup EXIT
bin="" commit="" against="" runs=5 threshold=20 cores=""
baseline="$root/benches/baseline/bench_report.txt" baseline_out=""
replay="" replay_against=""
bench_args=()
usage() { sed -n '/^# usage:/,/^# Env:/s/^# \{0,1\}//p' "$0"; }
while [ $# -gt 0 ]; do
    case "$1" in
        --bin) bin=${2:?--bin needs a path}; shift 2 ;;
        --commit) commit=${2:?--commit needs a revision}; shift 2 ;;
        --against) against=${2:?--against needs a binary or a revision}; shift 2 ;;
        --runs) runs=${2:?--runs needs a number}; shift 2 ;;
        --baseline) baseline=${2:?--baseline needs a file}; shift 2 ;;
        --baseline-out) baseline_out=${2:?--baseline-out needs a file}; shift 2 ;;
        --threshold) threshold=${2:?--threshold needs a percentage}; shift 2 ;;
        --cores) cores=${2:?--cores needs a number}; shift 2 ;;
        --replay) replay=${2:?--replay needs a file}; shift 2 ;;
        --replay-against) replay_against=${2:?--replay-against needs a file}; shift 2 ;;
        --) shift; bench_args=("$@"); break ;;
        -h|--help) usage; exit 0 ;;
        *) echo "bench-guard: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
done
fail() { echo "bench-guard: $*" >&2; exit 2; }
case "$runs" in ''|*[!0-9]*|0) fail "--runs takes a whole number > 0" ;; esac
case "$threshold" in ''|*[!0-9.]*) fail "--threshold takes a percentage" ;; esac
[ -n "$cores" ] || cores=$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN)
case "$cores" in ''|*[!0-9]*|0) fail "--cores takes a whole number > 0" ;; esac
[ -z "$bin" ] || [ -z "$commit" ] || fail "--bin and --commit exclude each other"
if [ -n "$replay" ]; then
    [ -z "$bin$commit$against" ] || fail "--replay judges a file: no --bin, --commit or --against"
    [ -f "$replay" ] || fail "no file $replay"
fi
if [ -n "$replay_against" ]; then
    [ -n "$replay" ] || fail "--replay-against needs --replay (the measured output)"
    [ -f "$replay_against" ] || fail "no file $replay_against"
fi
ab=no
if [ -n "$against" ] || [ -n "$replay_against" ]; then ab=yes; fi
[ "$ab" = no ] || [ -z "$baseline_out" ] || fail "--baseline-out writes one binary's ratios: not with A/B"
if [ "$ab" = no ] && [ -z "$baseline_out" ] && [ ! -f "$baseline" ]; then
    echo "bench-guard: no baseline at $baseline: measure a reference build with" >&2
    echo "  scripts/bench-guard.sh --commit REV --baseline-out $baseline" >&2
    echo "on a quiet machine and commit it (or judge A/B: --against REV)" >&2
    exit 2
fi

scratch=$(mktemp -d "${TMPDIR:-/tmp}/bench-guard.XXXXXX")
target=${CARGO_TARGET_DIR:-$root/target}
case "$target" in /*) ;; *) target="$root/$target" ;; esac

# bench_report of commit $1, built in a temporary worktree, copied to $2 (so that a second
# commit's build, into the same target directory, does not overwrite it).
build_rev() {
    local rev tree
    rev=$(git -C "$root" rev-parse --short "$1^{commit}") || fail "no commit $1"
    tree=$(mktemp -d "${TMPDIR:-/tmp}/bench-guard-tree.XXXXXX")
    trees+=("$tree")
    git -C "$root" worktree add --force --detach "$tree" "$rev" >/dev/null
    echo "bench-guard: building bench_report of $rev" >&2
    (cd "$tree" && CARGO_TARGET_DIR="$target/bench-guard" cargo build --release --example bench_report) >&2
    cp "$target/bench-guard/release/examples/bench_report" "$2"
}

new_out="$scratch/new.txt" old_out="$scratch/old.txt"
if [ -n "$replay" ]; then
    measured="the output in $replay"
    cp "$replay" "$new_out"
    if [ -n "$replay_against" ]; then
        reference="the output in $replay_against"
        cp "$replay_against" "$old_out"
    fi
else
    measured="this checkout ($(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$root" diff --quiet HEAD 2>/dev/null || echo ', with uncommitted changes'))"
    if [ -n "$commit" ]; then
        build_rev "$commit" "$scratch/bench_report-new"
        bin="$scratch/bench_report-new"
        measured="commit $(git -C "$root" rev-parse --short "$commit^{commit}")"
    elif [ -z "$bin" ]; then
        echo "bench-guard: building bench_report" >&2
        (cd "$root" && CARGO_TARGET_DIR="$target" cargo build --release --example bench_report) >&2
        cp "$target/release/examples/bench_report" "$scratch/bench_report-new"
        bin="$scratch/bench_report-new"
    else
        measured="$bin"
    fi
    [ -x "$bin" ] || fail "$bin is not an executable"
    old_bin=""
    if [ -n "$against" ]; then
        if [ -f "$against" ] && [ -x "$against" ]; then
            old_bin="$against"
            reference="$against"
        else
            build_rev "$against" "$scratch/bench_report-old"
            old_bin="$scratch/bench_report-old"
            reference="commit $(git -C "$root" rev-parse --short "$against^{commit}")"
        fi
    fi
    run_one() { # binary, output file, label, run number
        echo "bench-guard: run $4 of $runs ($3): $1 ${bench_args[*]:-}" >&2
        "$1" ${bench_args[@]+"${bench_args[@]}"} >>"$2" || fail "bench_report failed ($3, run $4)"
    }
    for i in $(seq 1 "$runs"); do
        # Interleaved: the reference first, then the measured binary, in the same minute.
        [ -z "$old_bin" ] || run_one "$old_bin" "$old_out" reference "$i"
        run_one "$bin" "$new_out" measured "$i"
    done
fi

# Each line's key is every field but the measured ones. Prints, per key in first-seen order:
# key, median ratio, best ratio, median speed (GB/s or GFLOP/s), runs.
summarize() {
    awk '
        function sort(a, n,    i, j, v) {
            for (i = 2; i <= n; i++) {
                v = a[i]
                for (j = i - 1; j >= 1 && a[j] > v; j--) a[j + 1] = a[j]
                a[j + 1] = v
            }
        }
        function median(a, n) { return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2 }
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
            if (speed != "" && memcpy + 0 > 0) ratio = speed / memcpy
            if (!(key in count)) { keys[++n] = key; count[key] = 0 }
            c = ++count[key]
            r[key, c] = ratio + 0
            s[key, c] = speed + 0
        }
        END {
            for (i = 1; i <= n; i++) {
                k = keys[i]; m = count[k]
                for (j = 1; j <= m; j++) { a[j] = r[k, j]; b[j] = s[k, j] }
                sort(a, m); sort(b, m)
                printf "%s\t%.4f\t%.4f\t%.2f\t%d\n", k, median(a, m), a[m], median(b, m), m
            }
        }
    ' "$1"
}

new=$(summarize "$new_out")
[ -n "$new" ] || fail "bench_report printed no line with a ratio ($measured)"

if [ -n "$baseline_out" ]; then
    mkdir -p "$(dirname "$baseline_out")"
    {
        echo "# bench_report ratios (median of $runs runs), written by scripts/bench-guard.sh --baseline-out"
        echo "# measured: $measured; $(date -u +%Y-%m-%dT%H:%MZ); $(uname -m), $cores cores, $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo 2>/dev/null | head -1)"
        echo "# bench_report args: ${bench_args[*]:-(none)}"
        printf '%s\n' "$new" | awk -F'\t' '{ print $1 " ratio=" $2 }'
    } >"$baseline_out"
    echo "bench-guard: wrote $(printf '%s\n' "$new" | wc -l) baseline ratios of $measured to $baseline_out"
    printf '%s\n' "$new" | awk -F'\t' '{ printf "%-62s %8s  ratio %6s (best %s)\n", $1, $4, $2, $3 }'
    exit 0
fi

# The reference: the A/B reference's medians, or the baseline's ratios (best fields empty).
if [ "$ab" = yes ]; then
    ref=$(summarize "$old_out")
    [ -n "$ref" ] || fail "bench_report printed no line with a ratio ($reference)"
    how="run interleaved"
    [ -z "$replay" ] || how="canned outputs"
    echo "bench-guard: A/B, $measured (new) against $reference (old), $how, median of each line's runs (flag: new/old down more than $threshold%)"
    ref_name="old"
else
    ref=$(awk '!/^#/ && / ratio=/ { i = index($0, " ratio="); printf "%s\t%s\t-\t-\t-\n", substr($0, 1, i - 1), substr($0, i + 7) }' "$baseline")
    echo "bench-guard: $measured, median of each line's runs, against $baseline (flag: median ratio down more than $threshold%)"
    echo "$(sed -n 's/^# bench_report ratios (\(.*\)), written.*/baseline: \1/p' "$baseline" | head -1)"
    ref_name="baseline"
fi
echo "speed: median algbw GB/s (memcpy_parallel: GB/s; gemm: our GFLOP/s); ratio: over memcpy GB/s of the same run (gemm: the gemm crate's time over ours); not judged: chunk, and lines of more than $cores ranks (this machine's cores)"

{ printf '%s\n' "$ref" | sed 's/^/R\t/'; printf '%s\n' "$new" | sed 's/^/N\t/'; } | awk -F'\t' \
    -v thr="$threshold" -v cores="$cores" -v refname="$ref_name" '
    function size(bytes) {
        if (bytes == "") return "-"
        if (bytes % 1048576 == 0) return (bytes / 1048576) "M"
        if (bytes % 1024 == 0) return (bytes / 1024) "K"
        return bytes
    }
    $1 == "R" { ref[$2] = $3 + 0; refbest[$2] = $4; next }
    $1 == "N" {
        ab = refname == "old"
        if (!header++) {
            printf "%-16s %-24s %6s %9s %8s %8s %8s", "op", "case", "size", "speed", "median", "best", refname
            printf (ab ? " %8s %7s\n" : "%s %7s\n"), (ab ? "old best" : ""), "change"
        }
        key = $2; med = $3 + 0; n = split(key, f, " "); op = ""; rest = ""; bytes = ""; width = 0
        for (i = 1; i <= n; i++) {
            split(f[i], kv, "=")
            if (kv[1] == "op") op = kv[2]
            else if (kv[1] == "bytes") bytes = kv[2]
            else if (kv[1] != "backend") rest = rest (rest == "" ? "" : " ") f[i]
            if (kv[1] == "ranks" || kv[1] == "threads") width = kv[2] + 0
        }
        if (!(key in ref)) {
            printf "%-16s %-24s %6s %9s %8.3f %8.3f %8s", op, rest, size(bytes), $5, med, $4, "-"
            printf (ab ? " %8s %7s\n" : "%s %7s\n"), (ab ? "-" : ""), "new"
            next
        }
        seen[key] = 1
        change = ref[key] > 0 ? (med / ref[key] - 1) * 100 : 0
        if (op == "chunk") mark = "  (a view: not judged)"
        else if (width > cores) mark = "  (oversubscribed: not judged)"
        else {
            mark = change < -thr ? "  LOST MORE THAN " thr "%" : ""
            if (mark != "") flagged++
        }
        printf "%-16s %-24s %6s %9s %8.3f %8.3f %8.3f", op, rest, size(bytes), $5, med, $4, ref[key]
        if (ab) printf " %8.3f", refbest[key]
        printf " %+6.0f%%%s\n", change, mark
    }
    END {
        missing = 0
        for (k in ref) if (!(k in seen)) missing++
        if (missing) printf "%d %s line(s) not measured in this run (other sizes or backends)\n", missing, refname
        if (flagged) { printf "bench-guard: %d line(s) lost more than %s%% of their %s ratio\n", flagged, thr, refname; exit 1 }
        print "bench-guard: no judged line lost more than " thr "% of its " refname " ratio"
    }
'
