#!/usr/bin/env bash
# A newer Triton for a GPU machine that has no package index (Python 3.12, x86_64 Linux, Hopper): FLA 0.6.0
# refuses its GDN backward (gated chunk_bwd_dqkwg, FLA issue #640) on Hopper under Triton >= 3.4 and < 3.7.1, and
# the machine has 3.6, so Megatron-Core's GDN trains there only with this. The wheel (198 MB) is trimmed of what a
# Hopper run never loads (the Blackwell ptxas, CUPTI's static libraries and profiler libraries, the proton
# profiler, the instrumentation plugins), packed as tar.xz (about 98 MB) and cut into parts that fit one device
# call each. Run from the repository root:
#
#   bash benchmarks/triton_prep.sh download [DIR]        # where pip reaches an index: triton==$VERSION for the GPU
#                                                        # machine's tags, then `pack` into DIR (default .whl/triton)
#   bash benchmarks/triton_prep.sh pack WHEEL DIR        # a Triton wheel already here: trimmed, packed, cut into
#                                                        # DIR/triton.tar.xz.part-aa, -ab ... with SHA256SUMS
#   bash benchmarks/triton_prep.sh install DIR TARGET    # on the GPU machine: join the parts, check the sum, unpack
#                                                        # into TARGET and print the PYTHONPATH line (TARGET first,
#                                                        # ahead of the installed Triton)
#
# Parts are PART_BYTES (default 55 MiB) each: carry them over several calls of one held machine, kept under /tmp
# there (an ignored folder carried by one call is not there at the next), then install.
set -euo pipefail
VERSION=${TRITON_VERSION:-3.7.1}
PART_BYTES=${PART_BYTES:-$((55 * 1024 * 1024))}
python=${PYTHON:-python3}
# paths inside the wheel that a Hopper run does not load
TRIM=(triton/backends/nvidia/bin/ptxas-blackwell triton/backends/nvidia/bin/nvdisasm triton/backends/nvidia/lib/cupti
      triton/_C/libproton.so triton/instrumentation triton/FileCheck)
STRIP=triton/_C/libtriton.so

pack() {
    local wheel=$1 dir=$2 work
    work=$(mktemp -d)
    trap 'rm -rf "$work"' RETURN
    "$python" -m zipfile -e "$wheel" "$work"
    (
        cd "$work"
        rm -rf "${TRIM[@]}"
        [ -f triton/__init__.py ] || { echo "pack: $wheel holds no triton/__init__.py" >&2; exit 1; }
        [ -f "$STRIP" ] || { echo "pack: $wheel holds no $STRIP" >&2; exit 1; }
        strip --strip-unneeded "$STRIP"
        # zipfile drops the mode bits; ptxas and cuobjdump are run as programs
        chmod a+x triton/backends/nvidia/bin/*
    )
    mkdir -p "$dir"
    rm -f "$dir"/triton.tar.xz.part-* "$dir/SHA256SUMS"
    tar cf - -C "$work" . | xz -T0 -6 > "$dir/triton.tar.xz"
    (cd "$dir" && sha256sum triton.tar.xz > SHA256SUMS)
    split -b "$PART_BYTES" "$dir/triton.tar.xz" "$dir/triton.tar.xz.part-"
    rm "$dir/triton.tar.xz"
    ls -l "$dir"
}

case "${1:?usage: triton_prep.sh download [DIR] | pack WHEEL DIR | install DIR TARGET}" in
download)
    dir=${2:-.whl/triton}
    wheels=$(mktemp -d)
    "$python" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 -d "$wheels" "triton==$VERSION"
    pack "$(ls "$wheels"/triton-*.whl)" "$dir"
    rm -rf "$wheels"
    ;;
pack)
    pack "${2:?pack WHEEL DIR: the wheel}" "${3:?pack WHEEL DIR: where the parts go}"
    ;;
install)
    dir=${2:?install DIR TARGET: the folder of the parts}
    target=${3:?install DIR TARGET: where to unpack}
    ls "$dir"/triton.tar.xz.part-* > /dev/null
    cat "$dir"/triton.tar.xz.part-* > "$dir/triton.tar.xz"
    if [ -e "$dir/SHA256SUMS" ]; then (cd "$dir" && sha256sum --check --quiet SHA256SUMS); fi
    mkdir -p "$target"
    xz -dc "$dir/triton.tar.xz" | tar xf - -C "$target"
    chmod a+x "$target"/triton/backends/nvidia/bin/*  # parts packed without the mode bits
    rm "$dir/triton.tar.xz"
    PYTHONPATH="$target:${PYTHONPATH:-}" "$python" -c \
        "import triton; print('triton', triton.__version__, 'from', triton.__file__)"
    echo "export PYTHONPATH=$target:\${PYTHONPATH:-}"
    ;;
*)
    echo "triton_prep.sh: unknown command ${1}; use download, pack or install" >&2
    exit 2
    ;;
esac
