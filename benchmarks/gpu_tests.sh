#!/usr/bin/env bash
# GPU test groups for one device call: each `-k` expression runs in its own pytest process under its own
# timeout, unbuffered, appended to one log, so a group killed by its timeout loses only itself (a pytest
# killed mid-run never prints its failures, and a pipe buffers what it did print). Triton's cache persists
# between the processes of one call: only the first group pays the compile.
#
#   bash benchmarks/gpu_tests.sh LOG SECONDS "k expression" [SECONDS "k expression" ...]
#   bash benchmarks/gpu_tests.sh $OUT/tests.log 150 "graph_decode_equals_eager or piecewise" 90 "fused_ops"
#
# Each test's start, outcome and failure is printed as it happens (tests/conftest.py, FERRY_TEST_TRACE), and a
# test still running 20 s before its group's timeout dumps every thread's stack (pytest's faulthandler_timeout).
# A k expression that names a test file (ends in .py) runs that file instead of tests/test_cuda.py; FILE.py::K runs
# that file's tests matching -k K.
set -u
log=$1
shift
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1 FERRY_TEST_TRACE=1
while [ $# -ge 2 ]; do
    secs=$1 expr=$2
    shift 2
    echo "=== $expr (timeout ${secs}s) $(date -u +%H:%M:%S)" >>"$log"
    if [[ $expr == *.py::* ]]; then  # FILE.py::K: that file's tests matching -k K
        target=(tests/"${expr%%::*}" -k "${expr#*::}")
    elif [[ $expr == *.py ]]; then
        target=(tests/"$expr")
    else
        target=(tests/test_cuda.py -k "$expr")
    fi
    timeout "$secs" python -m pytest -q -s --tb=short -p no:cacheprovider -o faulthandler_timeout=$((secs - 20)) "${target[@]}" 2>&1 |
        grep --line-buffered -v "^WARNING\|Writing model shards\|^  [a-z]" >>"$log"
    echo "=== exit ${PIPESTATUS[0]} $(date -u +%H:%M:%S)" >>"$log"
done
