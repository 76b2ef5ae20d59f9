#!/usr/bin/env bash
# llama.cpp's CUDA build of llama-bench and llama-batched-bench, for bench/vs_llamacpp.py.
#
#   tools/build_llamacpp.sh trim SDIST SRC_DIR    # here: a trimmed source tree small enough to
#                                                 # travel to the GPU machine (< 64 MiB)
#   tools/build_llamacpp.sh build SRC_DIR BUILD_DIR [cuda|cpu [CMAKE_ARGS...]]   # there (cuda,
#                                                 # the default): BUILD_DIR/bin/llama-bench and
#                                                 # llama-batched-bench
#
# SDIST is PyPI's llama-cpp-python source distribution (llama_cpp_python-X.tar.gz, or the folder
# it unpacks to); its vendor/llama.cpp is llama.cpp's source with gguf-py. `trim` copies that tree
# without what the two benchmarks do not build: docs, vocab models, tests, examples, benches, the
# server and its web UI, the conversion scripts, and every GGML backend but CPU and CUDA. gguf-py
# stays (tools/make_gguf.py can import it from SRC_DIR/gguf-py). Put SRC_DIR in an ignored folder
# of the repository (e.g. .wt/llamacpp) and carry it. `build` configures
#   -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF
# (nvcc from $CUDACXX, PATH, /usr/local/cuda or pip's nvidia wheels; cuBLAS from the toolkit or
# the wheels)
# and builds only the two targets (about 6 minutes
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

# cuBLAS and the driver library where the CUDA toolkit lacks them: jax[cuda13] brings cuBLAS as
# pip's nvidia wheels (site-packages/nvidia/cu13/{include,lib}, versioned .so names only) and the
# driver brings libcuda.so.1; links to them in BUILD_DIR/cuda-shim let CMake's FindCUDAToolkit
# find them, and the binaries load them from there (the build tree's rpath)
cuda_flags() {
    local out=$1 nvcc wheels
    wheels=$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))' \
             2>/dev/null || true)
    nvcc=${CUDACXX:-$(command -v nvcc || true)}
    for candidate in /usr/local/cuda/bin/nvcc "$wheels/bin/nvcc"; do
        [[ -n $nvcc || ! -x $candidate ]] || nvcc=$candidate
    done
    [[ -x $nvcc ]] || die "nvcc not found (set CUDACXX, or put nvcc on PATH)"
    printf "%s\n" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 "-DCMAKE_CUDA_COMPILER=$nvcc"
    mkdir -p "$out/cuda-shim"
    if ! echo '#include <cublas_v2.h>' | "$nvcc" -E -x cu - -o /dev/null 2>/dev/null; then
        [[ -f $wheels/include/cublas_v2.h ]] || die "no cublas_v2.h in the CUDA toolkit of $nvcc nor in pip's nvidia wheels"
        local lib found
        for lib in cublas cublasLt; do  # the link name, and the soname the binaries load (rpath)
            found=$(ls "$wheels"/lib/lib$lib.so.* | head -1)
            ln -sf "$found" "$out/cuda-shim/lib$lib.so"
            ln -sf "$found" "$out/cuda-shim/$(basename "$found")"
        done
        echo "-DCMAKE_CUDA_FLAGS=-I$wheels/include"
    fi
    local driver
    driver=$(ldconfig -p | awk '/libcuda\.so\.1 /{print $NF; exit}')
    [[ -z $driver ]] || ln -sf "$driver" "$out/cuda-shim/libcuda.so"
    echo "-DCMAKE_LIBRARY_PATH=$out/cuda-shim"
}

build() {
    local src=$1 out=$2 kind=$3 flags=()
    shift 3
    [[ -f $src/CMakeLists.txt ]] || die "$src: not a llama.cpp source tree (run trim first)"
    case $kind in
        cuda) mkdir -p "$out"; cuda_flags "$out" > "$out/cuda-flags"; mapfile -t flags < "$out/cuda-flags" ;;
        cpu) flags=(-DGGML_CUDA=OFF) ;;
        *) die "build kind '$kind': cuda or cpu" ;;
    esac
    local generator="Unix Makefiles"  # Ninja where the machine has it
    command -v ninja > /dev/null && generator=Ninja
    cmake -S "$src" -B "$out" -G "$generator" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DBUILD_SHARED_LIBS=OFF "${flags[@]}" "$@"
    cmake --build "$out" --target llama-bench llama-batched-bench -j "${JOBS:-$(nproc)}"
    ls -l "$out/bin/llama-bench" "$out/bin/llama-batched-bench"
}

case ${1:-} in
    trim) [[ $# -eq 3 ]] || die "usage: $0 trim SDIST SRC_DIR"; trim "$2" "$3" ;;
    build) [[ $# -ge 3 ]] || die "usage: $0 build SRC_DIR BUILD_DIR [cuda|cpu [CMAKE_ARGS...]]"
           build "$2" "$3" "${4:-cuda}" "${@:5}" ;;
    *) die "usage: $0 trim SDIST SRC_DIR | build SRC_DIR BUILD_DIR [cuda|cpu [CMAKE_ARGS...]]" ;;
esac
