#!/usr/bin/env bash
# Issue 15's targets in one run, as docs/benchmarks.md reports them: the peers in process
# (own kernel choice), one caller served against ONNX Runtime, serving, the FMA ceiling, S5's
# memory, 2-thread scaling, then the peers with OpenBLAS held to Haswell. Needs a build in
# build/ and scripts/bench-deps's venv. About 10 minutes on a 2-core host.
set -euo pipefail
cd "$(dirname "$0")/.."
own=(env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE)
date
git log --oneline -1
echo "### compare, OpenBLAS's own choice"
"${own[@]}" build/bench-venv/bin/python bench/compare.py --threads 2 --repeats 3 --no-ragged
echo "### served_vs_ort, own choice"
"${own[@]}" /usr/bin/python3 bench/served_vs_ort.py --repeats 3
echo "### serving, own choice"
"${own[@]}" /usr/bin/python3 bench/serving.py --rounds 3
echo "### ceiling"
"${own[@]}" build/bench/attention_bench \
  --benchmark_filter='BM_FmaPeak|BM_Bf16DotPeak|BM_Sgemm/n:1024/threads:1|BM_LinearCpu/rows:2048/packed:1'
echo "### S5 (peak RSS)"
"${own[@]}" /usr/bin/time -f 'peak RSS %M KiB' build/bench/attention_bench --benchmark_filter='BM_MhaS5'
echo "### scaling"
"${own[@]}" build/bench/attention_bench --benchmark_filter='BM_MhaS[12]/threads'
echo "### compare, Haswell forced"
OPENBLAS_CORETYPE=Haswell build/bench-venv/bin/python bench/compare.py --threads 2 --repeats 3 --no-ragged
date
