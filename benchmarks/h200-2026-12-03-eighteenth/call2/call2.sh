set -u
python3 -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/site .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl && python3 -m compileall -q -j 16 /tmp/site src >/dev/null
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
mkdir -p /tmp/tcache && tar xzf .whl/fla-autotune-h200.tgz -C /tmp/tcache
out=$OUT; source benchmarks/step.sh
step variants 200 python3 .abwork/variants.py
step ncu_stalls 150 ncu --clock-control none -k regex:_state_summary_kernel -c 1 --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio python3 .abwork/ncu_one.py
grep "^|" $out/variants.log; grep "stalled" $out/ncu_stalls.log | sort -k3 -n -r | head -14
step overlap 120 python3 .abwork/overlap.py
grep "^|" $out/overlap.log
