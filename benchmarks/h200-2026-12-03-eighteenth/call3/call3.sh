set -u
python3 -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/site .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl && python3 -m compileall -q -j 16 /tmp/site src >/dev/null
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
mkdir -p /tmp/tcache && tar xzf .whl/fla-autotune-h200.tgz -C /tmp/tcache
out=$OUT; source benchmarks/step.sh
step pieces_ab 150 python3 .abwork/pieces_ab.py
step ubranch 80 python3 .abwork/ubranch.py
step gpu_tests 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/backends tests/kernels tests/distributed/test_schedule.py
grep "^|\|backend" $out/pieces_ab.log $out/ubranch.log; tail -4 $out/gpu_tests.log
