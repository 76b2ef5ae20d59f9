#!/usr/bin/env bash
# llama.cpp's CUDA build of llama-bench and llama-batched-bench, for bench/vs_llamacpp.py.
#
#   tools/build_llamacpp.sh trim SDIST SRC_DIR    # here: a trimmed source tree small enough to
#                                                 # travel to the GPU machine (< 64 MiB)
#   tools/build_llamacpp.sh build SRC_DIR BUILD_DIR [cuda|cpu]   # there (cuda, the default):
#                                                 # BUILD_DIR/bin/llama-bench, llama-batched-bench
#
# SDIST is PyPI's llama-cpp-python source distribution (llama_cpp_python-X.tar.gz, or the folder
# it unpacks to); its vendor/llama.cpp is llama.cpp's source with gguf-py. `trim` copies that tree
# without what the two benchmarks do not build: docs, vocab models, tests, examples, benches, the
# server and its web UI, the conversion scripts, and every GGML backend but CPU and CUDA. gguf-py
# stays (tools/make_gguf.py can import it from SRC_DIR/gguf-py). Put SRC_DIR in an ignored folder
# of the repository (e.g. .wt/llamacpp) and carry it. `build` configures
#   -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF
# (nvcc from $CUDACXX, PATH or /usr/local/cuda) and builds only the two targets (about 6 minutes
# on the H200 machine's 16 cores: start it in the background while the checkpoints are written).
# `cpu` builds the same targets without CUDA (a check of the trimmed tree and of a GGUF here).
set -euo pipefail

die() { echo "error: $*" >&2; exit 2; }

trim() {
    local sdist=$1 dest=$2 tmp="" root
    if [[ -f $sdist ]]; then
        tmp=$(mktemp -d)
        tar -xzf "$sdist" -C "$tmp" --wildcards '*/vendor/llama.cpp/*'
        sdist=$(echo "$tmp"/*)
    fi
    root=$sdist/vendor/llama.cpp
    [[ -f $root/CMakeLists.txt ]] || die "$1: no vendor/llama.cpp/CMakeLists.txt (not a llama-cpp-python sdist)"
    [[ ! -e $dest ]] || die "$dest exists: remove it first"
    mkdir -p "$dest"
    local backends=(ggml/src/ggml-{blas,cann,et,hexagon,hip,metal,musa,opencl,openvino,rpc,sycl,virtgpu,vulkan,webgpu,zdnn,zendnn})
    # .git is a pointer to the sdist's build checkout, absent here: build-info reads "unknown"
    local drop=(.git docs models tests examples pocs benches media app conversion scripts .devops
                .github tools/server tools/ui tools/cli "${backends[@]}")
    tar -C "$root" $(printf -- '--exclude=./%s ' "${drop[@]}") -cf - . | tar -C "$dest" -xf -
    [[ -z $tmp ]] || rm -rf "$tmp"
    echo "$dest: $(du -sh "$dest" | cut -f1), llama.cpp of $(basename "$(dirname "$(dirname "$root")")")"
}

build() {
    local src=$1 out=$2 kind=${3:-cuda} flags=()
    [[ -f $src/CMakeLists.txt ]] || die "$src: not a llama.cpp source tree (run trim first)"
    case $kind in
        cuda)
            local nvcc=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
            [[ -x $nvcc ]] || die "nvcc not found (set CUDACXX, or put nvcc on PATH)"
            flags=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_COMPILER="$nvcc") ;;
        cpu) flags=(-DGGML_CUDA=OFF) ;;
        *) die "build kind '$kind': cuda or cpu" ;;
    esac
    cmake -S "$src" -B "$out" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DBUILD_SHARED_LIBS=OFF "${flags[@]}"
    cmake --build "$out" --target llama-bench llama-batched-bench -j "${JOBS:-$(nproc)}"
    ls -l "$out/bin/llama-bench" "$out/bin/llama-batched-bench"
}

case ${1:-} in
    trim) [[ $# -eq 3 ]] || die "usage: $0 trim SDIST SRC_DIR"; trim "$2" "$3" ;;
    build) [[ $# -ge 3 && $# -le 4 ]] || die "usage: $0 build SRC_DIR BUILD_DIR [cuda|cpu]"; build "$2" "$3" "${4:-cuda}" ;;
    *) die "usage: $0 trim SDIST SRC_DIR | build SRC_DIR BUILD_DIR [cuda|cpu]" ;;
esac
