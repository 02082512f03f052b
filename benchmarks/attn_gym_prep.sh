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
PART_BYTES=$((55 * 1024 * 1024))
python=${PYTHON:-python3}

case "${1:?usage: attn_gym_prep.sh download [DIR] | install DIR TARGET}" in
download)
    dir=${2:-.whl/attn_gym}
    mkdir -p "$dir"
    # the GPU machine's tags: CPython 3.12 on glibc >= 2.28 x86_64 (pure-Python wheels match any platform)
    "$python" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 -d "$dir" "${WHEELS[@]}"
    (cd "$dir" && sha256sum ./*.whl > SHA256SUMS)
    for whl in "$dir"/*.whl; do
        if [ "$(stat -c %s "$whl")" -gt "$PART_BYTES" ]; then
            split -b "$PART_BYTES" "$whl" "$whl.part-"
            rm "$whl"
        fi
    done
    ls -l "$dir"
    ;;
install)
    dir=${2:?install DIR TARGET: the folder of the wheels and parts}
    target=${3:?install DIR TARGET: where to install}
    for first in "$dir"/*.whl.part-aa; do
        [ -e "$first" ] || continue
        whl=${first%.part-aa}
        cat "$whl".part-* > "$whl"
    done
    if [ -e "$dir/SHA256SUMS" ]; then (cd "$dir" && sha256sum --check --quiet SHA256SUMS); fi
    "$python" -m pip install --quiet --no-deps --no-index --target "$target" "$dir"/*.whl
    export PYTHONPATH="$target:$target/nvidia_cutlass_dsl/dsl_packages:${PYTHONPATH:-}"
    "$python" - <<'EOF'
import importlib.util
missing = [m for m in ("cuda.bindings", "google.protobuf", "typing_extensions") if importlib.util.find_spec(m) is None]
print(("missing requirements of the CuTe DSL: " + ", ".join(missing)) if missing
      else "the CuTe DSL's requirements are here")
EOF
    echo "export PYTHONPATH=$target:$target/nvidia_cutlass_dsl/dsl_packages:\${PYTHONPATH:-}"
    ;;
*)
    echo "usage: attn_gym_prep.sh download [DIR] | install DIR TARGET" >&2
    exit 2
    ;;
esac
