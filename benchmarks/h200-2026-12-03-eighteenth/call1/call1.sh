set -u
python3 -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/site .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl && python3 -m compileall -q -j 16 /tmp/site src >/dev/null
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
mkdir -p /tmp/tcache && tar xzf .whl/fla-autotune-h200.tgz -C /tmp/tcache
out=$OUT; source benchmarks/step.sh
step sweep_regs 200 python3 .abwork/sweep_regs2.py
step probe_chain 90 python3 .abwork/probe_chain.py
step ncu 200 ncu --clock-control none -k regex:_state_summary_kernel -c 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats python3 .abwork/ncu_one.py
grep "^|" $out/sweep_regs.log; grep "^|" $out/probe_chain.log; tail -5 $out/ncu.log
