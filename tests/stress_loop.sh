#!/usr/bin/env bash
# Run the test suite N times in a row while CPU-heavy burner processes run beside it, and stop at
# the first failure: the check that the suite does not flake on a busy machine.
#
# Usage: tests/stress_loop.sh [N] [BURNERS] [-- PYTEST_ARGS...]
#   N        runs (default 5)
#   BURNERS  python busy-loop processes beside the suite (default 2: this machine has 2 cores)
#   PYTEST_ARGS  when given, each run is `ruff check .` + `pytest -q PYTEST_ARGS` (a subset)
#                instead of `make test`
#   LINT=0 in the environment skips ruff in subset runs.
# Example: LINT=0 tests/stress_loop.sh 1 1 -- tests/test_metrics.py
# Prints each run's pass/fail counts and wall time; exit status 1 at the first failing run.
set -u
cd "$(dirname "$0")/.."

N=5
BURNERS=2
if [ $# -gt 0 ] && [ "$1" != "--" ]; then N=$1; shift; fi
if [ $# -gt 0 ] && [ "$1" != "--" ]; then BURNERS=$1; shift; fi
if [ $# -gt 0 ] && [ "$1" = "--" ]; then shift; fi
PY=${PY:-.venv/bin/python}

pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
    wait 2>/dev/null
}
trap cleanup EXIT INT TERM

for _ in $(seq "$BURNERS"); do
    "$PY" -c 'while True: sum(i * i for i in range(10**6))' &
    pids+=($!)
done
echo "stress: $N run(s), $BURNERS burner(s) (pids ${pids[*]:-none})"

log=$(mktemp -t icqs-stress.XXXXXX)
for i in $(seq "$N"); do
    start=$(date +%s)
    if [ $# -gt 0 ]; then
        ( if [ "${LINT:-1}" != 0 ]; then "$PY" -m ruff check . || exit 1; fi
          .venv/bin/pytest -q "$@" ) >"$log" 2>&1
    else
        make test >"$log" 2>&1
    fi
    rc=$?
    secs=$(( $(date +%s) - start ))
    summary=$(grep -E '^[=]* ?[0-9]+ (passed|failed)|^[0-9]+ (passed|failed)|(passed|failed|error).* in [0-9.]+s' "$log" | tail -1)
    echo "run $i/$N: rc=$rc ${secs}s ${summary:-<no pytest summary>}"
    if [ $rc -ne 0 ]; then
        echo "stress: run $i failed; its output:"
        tail -60 "$log"
        rm -f "$log"
        exit 1
    fi
done
rm -f "$log"
echo "stress: all $N run(s) passed"
