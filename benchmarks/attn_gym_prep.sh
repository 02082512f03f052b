#!/usr/bin/env bash
# attention-gym 0.0.17 with its [linear] extra for backend="attn_gym", carried to a GPU machine that has no package
# index (Python 3.12, x86_64 Linux, CUDA 13 wheels of the CuTe DSL). Run from the repository root:
#
#   bash benchmarks/attn_gym_prep.sh download [DIR]        # where pip reaches an index: the wheels into DIR (default
#                                                          # .whl/attn_gym), each over 55 MB cut into parts
#                                                          # NAME.part-aa, NAME.part-ab ... (under 60 MB each), with
#                                                          # SHA256SUMS of the whole wheels
#   bash benchmarks/attn_gym_prep.sh install DIR TARGET    # on the GPU machine: join the parts, check the sums (where
#                                                          # SHA256SUMS is there), install
#                                                          # the wheels into TARGET (pip --target, no index, no deps)
#                                                          # and print the PYTHONPATH line to use
#
# The DSL puts itself on sys.path through a .pth file, which an install with --target does not run: hence
# TARGET/nvidia_cutlass_dsl/dsl_packages on PYTHONPATH beside TARGET. The DSL's own requirements (cuda-bindings,
# cuda-pathfinder, protobuf) come along; typing-extensions (torch's) is looked for.
set -euo pipefail
WHEELS=(attn-gym==0.0.17 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
        nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.15.post2
        cuda-bindings==13.5.0 cuda-pathfinder==1.9.1 protobuf==7.36.2)
source "$(dirname "$0")/wheels.sh"  # wheel_prep, download_wheels, install_wheels

after_install() {
    local target=$1
    export PYTHONPATH="$target:$target/nvidia_cutlass_dsl/dsl_packages:${PYTHONPATH:-}"
    "$python" - <<'EOF'
import importlib.util
missing = [m for m in ("cuda.bindings", "google.protobuf", "typing_extensions") if importlib.util.find_spec(m) is None]
print(("missing requirements of the CuTe DSL: " + ", ".join(missing)) if missing
      else "the CuTe DSL's requirements are here")
EOF
    echo "export PYTHONPATH=$target:$target/nvidia_cutlass_dsl/dsl_packages:\${PYTHONPATH:-}"
}

wheel_prep attn_gym "$@"
