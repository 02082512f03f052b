#!/usr/bin/env bash
# FlashQLA 0.1.3 (package flash-qla: TileLang GDN kernels for Hopper and Blackwell, the peer beside kdacp's split in
# benchmarks/split_heads.py) carried to a GPU machine that has no package index. Run from the repository root:
#
#   bash benchmarks/flashqla_prep.sh download [DIR]       # where pip reaches an index: the wheels into DIR (default
#                                                         # .whl/flashqla; about 80 MB, tilelang cut into parts under
#                                                         # 55 MB: carry them over two calls while the machine is held)
#   bash benchmarks/flashqla_prep.sh install DIR TARGET   # on the GPU machine: join, check, install into TARGET and
#                                                         # print the PYTHONPATH line to use
#
# TileLang compiles its kernels at first use with the machine's nvcc. torch and numpy are the machine's own.
set -euo pipefail
WHEELS=(flash-qla==0.1.3 tilelang==0.1.15 "apache-tvm-ffi>=0.1.11,<0.1.13" "z3-solver>=4.13.0,<4.15.5"
        torch-c-dlpack-ext cloudpickle ml-dtypes)
source "$(dirname "$0")/wheels.sh"  # wheel_prep, download_wheels, install_wheels

after_install() {
    local target=$1
    PYTHONPATH="$target:${PYTHONPATH:-}" "$python" -c "import flash_qla; print('flash_qla', flash_qla.__version__)"
    echo "export PYTHONPATH=$target:\${PYTHONPATH:-}"
}

wheel_prep flashqla "$@"
