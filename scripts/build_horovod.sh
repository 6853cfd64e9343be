#!/usr/bin/env bash
# Build horovod 0.28.1 (PyTorch + TensorFlow + Gloo, no MPI/MXNet) once into a wheel cache outside the
# checkout and install it into a venv.
#
#   scripts/build_horovod.sh [VENV]        (default .venv)
#
# The PyPI sdist does not build against torch 2.13 unpatched: it forces C++14 while the torch
# headers need C++17+. We raise CMAKE_CXX_STANDARD to 17 (top-level CMakeLists.txt) and 20
# (horovod/torch/CMakeLists.txt). With TensorFlow 2.21 one more file fails: horovod/tensorflow/xla_mpi_ops.cc
# includes xla/printer.h, which needs highwayhash headers the TF wheel does not ship; we drop that file (the XLA
# ops are only for jit-compiled functions; hvd.keras and hvd.DistributedGradientTape do not use them). If the
# TensorFlow part still fails to build, the wheel is rebuilt with PyTorch only (and says so). Runtime deps: cloudpickle psutil pyyaml packaging cffi. Needs cmake and a C++ compiler. ~4 min on 2 cores.
# The wheel is cached in ${DPRO_WHEEL_CACHE:-~/.cache/dpro/wheels}/torch-tf; a cached wheel skips the build.
# On success touches $VENV/.horovod-installed (the Makefile's stamp).
set -euo pipefail

VENV=${1:-.venv}
PY="$VENV/bin/python"
VERSION=0.28.1
CACHE=${DPRO_WHEEL_CACHE:-$HOME/.cache/dpro/wheels}/torch-tf  # wheels cached before TF support lie one level up
mkdir -p "$CACHE"

[ -x "$PY" ] || { echo "build_horovod.sh: no python at $PY" >&2; exit 1; }

wheel() { ls "$CACHE"/horovod-$VERSION-*.whl 2>/dev/null | head -n 1; }
WITH_TF=0
"$PY" -c "import tensorflow" 2>/dev/null && WITH_TF=1

build() {  # build SRC's wheel into $WORK/dist; $1 = 1 to include TensorFlow
    local tf_flag=HOROVOD_WITHOUT_TENSORFLOW
    [ "$1" = 1 ] && tf_flag=HOROVOD_WITH_TENSORFLOW
    rm -rf "$SRC/build" "$WORK/dist"
    env HOROVOD_WITH_PYTORCH=1 "$tf_flag=1" HOROVOD_WITHOUT_MXNET=1 \
        HOROVOD_WITHOUT_MPI=1 HOROVOD_WITH_GLOO=1 \
        MAKEFLAGS="-j$(nproc)" HOROVOD_BUILD_ARCH_FLAGS="${HOROVOD_BUILD_ARCH_FLAGS:-}" \
        "$PY" -m pip wheel --no-deps --no-build-isolation -w "$WORK/dist" "$SRC"
}

if [ -z "$(wheel)" ]; then
    command -v cmake >/dev/null || { echo "build_horovod.sh: cmake not found" >&2; exit 1; }
    WORK=$(mktemp -d)
    trap 'rm -rf "$WORK"' EXIT
    echo "build_horovod.sh: building horovod $VERSION wheel (several minutes) in $WORK"
    start=$(date +%s)
    "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$VERSION" -d "$WORK"
    tar -xzf "$WORK"/horovod-$VERSION.tar.gz -C "$WORK"
    SRC="$WORK/horovod-$VERSION"
    sed -i -E 's/(set\(CMAKE_CXX_STANDARD )[0-9]+\)/\117)/' "$SRC/CMakeLists.txt"
    sed -i -E 's/(set\(CMAKE_CXX_STANDARD )[0-9]+\)/\120)/' "$SRC/horovod/torch/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$SRC/CMakeLists.txt" || { echo "patch of CMakeLists.txt failed" >&2; exit 1; }
    grep -q 'CMAKE_CXX_STANDARD 20' "$SRC/horovod/torch/CMakeLists.txt" || { echo "patch of horovod/torch/CMakeLists.txt failed" >&2; exit 1; }
    sed -i -E 's#^list\(APPEND TF_SOURCES "\$\{PROJECT_SOURCE_DIR\}/horovod/tensorflow/xla_mpi_ops.cc"\)#\# dpro: xla_mpi_ops.cc dropped (highwayhash headers missing from the TF wheel)#' \
        "$SRC/horovod/tensorflow/CMakeLists.txt"
    # the build imports torch (and TensorFlow), so it must see the venv's packages (no build isolation)
    if [ "$WITH_TF" = 1 ] && build 1 > "$WORK/build-tf.log" 2>&1; then
        echo "build_horovod.sh: built with PyTorch and TensorFlow"
    else
        [ "$WITH_TF" = 1 ] && { echo "build_horovod.sh: the TensorFlow part did not build; last lines:"; \
            grep -E "error|Error" "$WORK/build-tf.log" | tail -n 5; echo "build_horovod.sh: building with PyTorch only"; }
        build 0
    fi
    cp "$WORK"/dist/horovod-$VERSION-*.whl "$CACHE"/
    echo "build_horovod.sh: built $(basename "$(wheel)") in $(( $(date +%s) - start )) s"
else
    echo "build_horovod.sh: using cached $(wheel)"
fi

"$PY" -m pip install -q --no-deps --force-reinstall "$(wheel)"
"$PY" -m pip install -q cloudpickle psutil pyyaml packaging cffi
"$PY" -c "import horovod.torch" || { echo "build_horovod.sh: import horovod.torch failed" >&2; exit 1; }
if [ "$WITH_TF" = 1 ]; then
    "$PY" -c "import horovod.tensorflow.keras" 2>/dev/null && echo "build_horovod.sh: horovod.tensorflow.keras imports" \
        || echo "build_horovod.sh: this wheel has no TensorFlow support (horovod.tensorflow.keras does not import)"
fi
touch "$VENV/.horovod-installed"
echo "build_horovod.sh: horovod $VERSION installed into $VENV"
