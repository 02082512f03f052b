set -u
python3 -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/site .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl && python3 -m compileall -q -j 16 /tmp/site src >/dev/null
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
mkdir -p /tmp/tcache && tar xzf .whl/fla-autotune-h200.tgz -C /tmp/tcache
out=$OUT; source benchmarks/step.sh
git log --oneline -1 > $out/commit.txt; git status --short >> $out/commit.txt
step ab_kda_tailfirst 70 python3 benchmarks/schedule_ab.py .abwork/orchestration_tailfirst.py --family kda --batch lognormal
step ab_kda_streams 70 python3 benchmarks/schedule_ab.py .abwork/orchestration_streams.py --family kda --batch lognormal
step sweep_gdn 70 python3 .abwork/sweep_gdn.py
step kernel_tests 150 python3 -m pytest -q -m gpu tests/kernels
step overhead 150 python3 -m kdacp.cli bench --suite overhead --device cuda --seq-lens 16384 --batches one_sequence --out "$out/overhead"
for f in ab_kda_tailfirst ab_kda_streams sweep_gdn; do grep "^|" $out/$f.log; done; tail -2 $out/kernel_tests.log; grep "| kda\|| gdn" $out/overhead.log | head -12
