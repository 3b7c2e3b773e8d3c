#!/usr/bin/env bash
# MLX's CUDA backend for the MLX-LM column on the lent GPU machine. Its wheel (90 MB) is
# over what one device call carries beside .whl (64 MiB in all), so it travels in three
# parts, one a call (carry .whl and .mlxp1, then .mlxp2, then .mlxp3, on a warm machine):
#   here:   bash scripts/mlx_cuda.sh split    -> .mlxp1/ .mlxp2/ .mlxp3/ (git-ignored)
#   there:  bash scripts/mlx_cuda.sh keep     (each call: the carried part to /tmp/mlxparts)
#           bash scripts/mlx_cuda.sh install  (once all three are there: joins them and
#                                              installs mlx + mlx-cuda-13 into /tmp/mlxcuda)
# then run with PYTHONPATH=/tmp/mlxcuda:/tmp/site:$PWD. mlx and its backend must share one
# target: installed beside an mlx already in /tmp/site, pip skipped it and libmlx.so was missing.
set -euo pipefail
cd "$(dirname "$0")/.."
version=0.32.4
wheel=mlx_cuda_13-$version-py3-none-manylinux_2_35_x86_64.whl
case ${1:?split, keep or install} in
    split)
        tmp=$(mktemp -d)
        .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux_2_35_x86_64 -d "$tmp" "mlx-cuda-13==$version"
        rm -rf .mlxp1 .mlxp2 .mlxp3 && mkdir -p .mlxp1 .mlxp2 .mlxp3
        (cd "$tmp" && split -b 30m "$wheel" part.)
        mv "$tmp/part.aa" .mlxp1/ && mv "$tmp/part.ab" .mlxp2/ && mv "$tmp/part.ac" .mlxp3/
        rm -rf "$tmp"
        for d in .mlxp1 .mlxp2 .mlxp3; do
            grep -qx "/$d/" .git/info/exclude || echo "/$d/" >> .git/info/exclude
        done
        du -sh .whl .mlxp1 .mlxp2 .mlxp3 ;;
    keep)
        mkdir -p /tmp/mlxparts
        cp .mlxp*/part.* /tmp/mlxparts/ 2>/dev/null || true
        ls /tmp/mlxparts ;;
    install)
        ls /tmp/mlxparts/part.aa /tmp/mlxparts/part.ab /tmp/mlxparts/part.ac >/dev/null
        cat /tmp/mlxparts/part.a? > "/tmp/$wheel"
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mlxcuda \
            .whl/mlx-$version-*.whl "/tmp/$wheel"
        PYTHONPATH=/tmp/mlxcuda:/tmp/site python3 -c \
            "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())" ;;
    *) echo "unknown mode $1 (split, keep or install)" >&2; exit 2 ;;
esac
