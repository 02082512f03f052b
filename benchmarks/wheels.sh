# Wheels carried to a GPU machine that has no package index (CPython 3.12, glibc >= 2.28, x86_64), sourced by the
# *_prep.sh scripts:
#   download_wheels DIR SPEC...   the wheels of SPEC... (no dependencies) into DIR for the GPU machine's tags, with
#                                 SHA256SUMS of the whole wheels, each wheel over 55 MB cut into NAME.part-aa,
#                                 NAME.part-ab ... (a call to the device machine carries at most 64 MiB)
#   install_wheels DIR TARGET     on the GPU machine: join the parts, check the sums (where SHA256SUMS is there) and
#                                 install every wheel of DIR into TARGET (pip --target, no index, no dependencies)
#   wheel_prep NAME ARG...        a *_prep.sh script's command line, "download [DIR]" (default .whl/NAME) or
#                                 "install DIR TARGET", for the wheels of the caller's WHEELS array; after an install
#                                 it calls the caller's after_install TARGET (checks, and the PYTHONPATH line to use)
PART_BYTES=$((55 * 1024 * 1024))
python=${PYTHON:-python3}

download_wheels() {
    local dir=$1
    shift
    mkdir -p "$dir"
    # pure-Python wheels match any platform; some binary ones are tagged for older glibc only
    "$python" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$dir" "$@"
    (cd "$dir" && sha256sum ./*.whl > SHA256SUMS)
    for whl in "$dir"/*.whl; do
        if [ "$(stat -c %s "$whl")" -gt "$PART_BYTES" ]; then
            split -b "$PART_BYTES" "$whl" "$whl.part-"
            rm "$whl"
        fi
    done
    ls -l "$dir"
}

install_wheels() {
    local dir=$1 target=$2
    for first in "$dir"/*.whl.part-aa; do
        [ -e "$first" ] || continue
        local whl=${first%.part-aa}
        cat "$whl".part-* > "$whl"
    done
    if [ -e "$dir/SHA256SUMS" ]; then (cd "$dir" && sha256sum --check --quiet SHA256SUMS); fi
    "$python" -m pip install --quiet --no-deps --no-index --target "$target" "$dir"/*.whl
}

wheel_prep() {
    local name=$1
    case "${2:?usage: ${name}_prep.sh download [DIR] | install DIR TARGET}" in
    download)
        download_wheels "${3:-.whl/$name}" "${WHEELS[@]}"
        ;;
    install)
        local dir=${3:?install DIR TARGET: the folder of the wheels and parts}
        local target=${4:?install DIR TARGET: where to install}
        install_wheels "$dir" "$target"
        after_install "$target"
        ;;
    *)
        echo "usage: ${name}_prep.sh download [DIR] | install DIR TARGET" >&2
        exit 2
        ;;
    esac
}
