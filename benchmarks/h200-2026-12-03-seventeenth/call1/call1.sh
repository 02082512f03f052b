set -u
python3 -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/site .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl && python3 -m compileall -q -j 16 /tmp/site src >/dev/null
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
mkdir -p /tmp/tcache && tar xzf .whl/fla-autotune-h200.tgz -C /tmp/tcache
out=$OUT; source benchmarks/step.sh
nvidia-smi --query-gpu=name,utilization.gpu,memory.used --format=csv > $out/gpu.txt
git log --oneline -1 > $out/commit.txt; git status --short >> $out/commit.txt
step sweep_vf 120 python3 .abwork/sweep_vf.py
step sweep_vf2 70 python3 .abwork/sweep_vf2.py
step ab_kda_lognormal 100 python3 benchmarks/schedule_ab.py .abwork/orchestration_3f6.py --family kda --batch lognormal --detail
step ab_kda_streams 80 python3 benchmarks/schedule_ab.py .abwork/orchestration_streams.py --family kda --batch lognormal --detail
step ab_gdn_lognormal 75 python3 benchmarks/schedule_ab.py .abwork/orchestration_3f6.py --family gdn --batch lognormal
step profile_kda 75 python3 benchmarks/packed_rank_profile.py --batch lognormal --family kda
cat $out/sweep_vf.log $out/sweep_vf2.log | grep "^|"
for f in ab_kda_lognormal ab_kda_streams ab_gdn_lognormal; do grep "^|" $out/$f.log; done
grep -v "0.00e+00, new vs one device 0.00e+00" $out/ab_kda_streams.log | grep "vs" | head -5
grep -A9 "through:" $out/profile_kda.log | head -12; tail -2 $out/gpu_tests.log
