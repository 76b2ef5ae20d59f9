#!/usr/bin/env bash
# One device call's worth of a GPU measurement (issue 27's parts A-D first), in the foreground
# (a machine goes back 30 s after a call ends: nothing may run across two calls, but a call made
# at once finds it warm, its files kept), each part within 9.5 minutes:
#
#   run(command="bash bench/gpu_round.sh A", carry=[".whl"], timeout_s=590)
#
# Parts I and J also carry llama.cpp's trimmed source (I builds it, J needs only I's build, on
# the same warm machine):
#   python -m pip download --no-deps --no-binary :all: -d /tmp/sdist llama-cpp-python
#   bash tools/build_llamacpp.sh trim /tmp/sdist/llama_cpp_python-*.tar.gz .wt/llamacpp
#   run(command="bash bench/gpu_round.sh I", carry=[".whl", ".wt/llamacpp"], timeout_s=590)
#
# .whl holds jax-triton's wheel (the GPU image has triton, not jax-triton, and no internet),
# installed without its requirements (the image has them; pip's resolver, offline, refuses):
#   python -m pip download --no-deps -d .whl jax-triton
# Parts A-E write the 40-layer V4.1 synthetic first where this machine has none (~30 s), F-J
# their own checkpoint (removing the others: the disk holds one); each leaves its tables under
# $OUT (copy each figure into RESULTS.md with the command, date, card and jax version).
#   A  the Triton kernels' tests on the GPU; mHC and Sinkhorn parts alone; the decode step's
#      profile (1 and 4 lanes) under engine.mhc_front chain and fused
#   B  the 40-layer roofline: decode at 1 and 4 lanes, TTFT of an 8K prompt, the warm-up's time
#   C  a 2,048-token prefill chunk's profile (MoE by pallas_dots and by triton); prompt
#      caching's turn 2
#   D  a cold start and a warm one (the compile cache and the step executables read back)
#   E  issue 34: a quarter of the experts on the GPU, all or half of them in host memory (the
#      rest read from disk by demand), the router's own picks; the disk's direct-read rate
#   F  issue 33: a verify step of k + 1 positions against a one-token step, k = 1..4 (40-layer
#      V3-family synthetic with an MTP layer); the demo model's decode with speculation on
#   G  issue 30: GLM-4.5-Air's shape, 46 layers of 64 experts: decode at 1 and 4 lanes all
#      resident and at 65% (router's own picks), TTFT of a 4K prompt, against the read roofline
#   H  issue 30: GLM-5's shape (DSA), 12 layers of 64 experts: decode and TTFT of an 8K prompt
#      (past index_topk 2,048: the sparse selection) against the read roofline
#   I  issues 28 and 29: llama.cpp built, the 40-layer V3-family synthetic and its GGUF written,
#      llama.cpp's decode and prefill at 100% and 65% of the experts on the GPU
#   J  (after I, the machine still warm) tidejax on the same weights, then its 64% decode by
#      policy (exact, cpu, auto, substitute) against the roofline: the vs_llamacpp table
set -euo pipefail
part=${1:?A to J}
OUT=${OUT:-/tmp/gpu_round}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
py=python3
if [ -d .whl ]; then
    $py -m pip install -q --no-index --no-deps .whl/jax_triton-*.whl
fi
if ! $py -c "import jax_triton"; then
    echo "jax-triton does not import: the kernels would not run" >&2
    exit 1
fi
base=(--set model.dtype=bfloat16 --set model.dense_format=fp8 --set engine.prefill_chunk=2048
      --set engine.compile_cache=/root/xla)
own() {  # part $part's checkpoint at $1, the others removed (make_synthetic's arguments after)
    model=$1; shift
    for other in /root/v40 /root/v3mtp /root/glm45air /root/glm5 /root/v3; do
        [ "$other" = "$model" ] || rm -rf "$other"
    done
    [ "$model" = /root/v3 ] || rm -f /root/v3.gguf  # its GGUF beside it
    [ -d "$model" ] || $py -m tools.make_synthetic "$model" "$@" --workers 14
}
case $part in
F) own /root/v3mtp --shape v41-flash --layers 40 --dense-layers 1 --n-experts 16 --mtp-layers 1 ;;
G) own /root/glm45air --shape glm45-air --layers 46 --n-experts 64 ;;
H) own /root/glm5 --shape glm5 --layers 12 --n-experts 64 ;;
I|J) own /root/v3 --shape v41-flash --layers 40 --dense-layers 1 --n-experts 16 \
        --max-positions 131072 ;;
*) own /root/v40 --shape ds41-flash --layers 40 --n-experts 32 --engram-gib 1 --vocab 129280 ;;
esac
step() {  # a named command, its output kept whole under $OUT and its tail shown
    local name=$1; shift
    echo "== $name: $*"
    local t0=$SECONDS
    "$@" > "$OUT/$name.log" 2>&1 || echo "!! $name exited $?"
    tail -n 25 "$OUT/$name.log"
    echo "== $name: $((SECONDS - t0)) s"
}
case $part in
A)
    step kernel_tests $py -m pytest -v -rA -p no:xdist -p no:cacheprovider -o addopts="" \
        tests/pallas/test_mhc.py tests/pallas/test_sinkhorn.py
    # the unrolled and elementwise Sinkhorn forms take minutes each to compile over 80 sites
    step v41_parts $py -m bench.v41_parts --parts mhc,sinkhorn --tokens 1,4,2048 \
        --forms reference,triton
    for front in chain fused; do
        step "decode_profile_$front" $py -m bench.profile_step $model --lanes 1,4 \
            --resident 1.0 --depth 5 "${base[@]}" --set engine.mhc_front=$front
    done
    ;;
B)
    step roofline $py -m bench.roofline $model --trace en --resident 1.0 --policies exact \
        --lanes 1,4 --tokens 64 --ttft 8192 "${base[@]}"
    ;;
C)
    for moe in pallas_dots triton; do
        step "chunk_profile_$moe" $py -m bench.profile_step $model --lanes 1 --prefill 2048 \
            --resident 1.0 --depth 5 "${base[@]}" --set engine.moe_prefill=$moe
    done
    step prompt_cache $py -m bench.prompt_cache $model "${base[@]}"
    ;;
D)
    step start $py -m bench.start $model --cache /root/xla_start --set model.dtype=bfloat16 \
        --set model.dense_format=fp8 --set engine.prefill_chunk=2048
    ;;
E)
    # warm-up off: each configuration compiles only the shapes it runs (four engines)
    step disk_tier $py -m bench.roofline $model --trace '' --resident 0.25 --host 1.0,0.5 \
        --policies exact,substitute --lanes 1,4 --tokens 64 --ttft 0 "${base[@]}" \
        --set engine.warmup=false
    ;;
F)
    step verify_step $py -m bench.verify_step $model --ks 1,2,3,4 --lanes 1,4 --tokens 48 \
        --set model.dtype=bfloat16 --set engine.compile_cache=/root/xla
    step speculation $py -m bench.speculation --ks 1,2,3
    ;;
G)
    step glm45air $py -m bench.roofline $model --trace '' --resident 1.0,0.65 --policies exact \
        --lanes 1,4 --tokens 64 --ttft 4096 --set model.dtype=bfloat16 \
        --set engine.prefill_chunk=2048 --set engine.compile_cache=/root/xla
    ;;
H)
    step glm5 $py -m bench.roofline $model --trace '' --resident 1.0 --policies exact \
        --lanes 1,4 --tokens 64 --ttft 8192 --set model.dtype=bfloat16 \
        --set engine.prefill_chunk=2048 --set engine.compile_cache=/root/xla
    ;;
I)
    step build_llamacpp bash tools/build_llamacpp.sh build .wt/llamacpp /root/lcpp cuda
    [ -f /root/v3.gguf ] || PYTHONPATH=$PWD:$PWD/.wt/llamacpp/gguf-py \
        step gguf $py -m tools.make_gguf $model /root/v3.gguf
    step vs_llamacpp_theirs $py -m bench.vs_llamacpp --llama /root/lcpp --gguf /root/v3.gguf \
        --model $model --engines llama.cpp --resident 1.0,0.65
    ;;
J)
    step vs_llamacpp_ours $py -m bench.vs_llamacpp --model $model --engines tidejax \
        --resident 1.0,0.65 --set model.dtype=bfloat16
    step policies $py -m bench.roofline $model --trace '' --resident 0.641 \
        --policies exact,cpu,auto,substitute --lanes 1,4 --tokens 64 --ttft 0 \
        --set model.dtype=bfloat16 --set engine.max_context=4096
    ;;
*)
    echo "part $part: expected A to J" >&2
    exit 2
    ;;
esac
