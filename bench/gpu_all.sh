#!/usr/bin/env bash
# Everything to run the day a GPU is lent, in one command, with one summary table at the end:
#
#     bash bench/gpu_all.sh [OUT_DIR]        # default OUT_DIR: runs/gpu-<date>
#
# 1. the CUDA sub-suite on the GPU, not simulated (HPCTRAIN_SUBSUITE=cuda, NUMBA_ENABLE_CUDASIM unset);
# 2. the library GEMM against cuBLAS SGEMM (TF32 off) at 1024², 2048², 4096² and gpt-char's shapes (bench_cuda_gemm.py);
# 2b. the cuBLASLt provider in fp32, tf32 and bf16 against the numba GEMM and PyTorch/CuPy at 4096² and
#     nanoGPT's shapes (bench_cublaslt.py, step cublaslt);
# 3. the GEMM variants' own sweeps (bench/history/cuda_gemm_3_regblock.py, bench/history/cuda_gemm_4_pipelined.py);
# 4. one MLP training step against PyTorch (bench/bench_cuda_step.py, batch 1024, hidden 4096);
# 5. one GPT training step against PyTorch (bench/bench_gpt.py --backend cuda): gpt-char's shape (gpt_step),
#    nanoGPT shakespeare-char's (gpt_nanogpt), and that with dropout 0.2 on both sides (gpt_dropout), and with
#    model.attention = "flash" (gpt_flash); gpt-char's again without the step arena (gpt_step_no_arena: the arena's
#    gain is gpt_step against it, each printing its last step's allocations and launches from Python), and without
#    the step's CUDA graphs (gpt_step_no_graphs: the graphs' gain, segment launches against kernel launches);
#    nanoGPT's shape in train.precision = "bf16" against PyTorch's bf16 autocast (gpt_bf16), and GPT-2 small's
#    (12 layers, width 768, block 1024, vocabulary 50304, batch 8) the same way with its MFU (gpt2_small_bf16);
# 6. the compile report of every kernel (bench/cuda_sass_report.py), beside the measured figures.
# Its figures land in docs/performance.md ("GPU step", "GEMM"); each lease's runs in docs/performance-log.md.
# Each step's full output is kept in OUT_DIR/<step>.log; a failing step is marked in the table and
# the others still run. Needs numba-cuda, PyTorch (or CuPy) with CUDA, mpi4py and h5py.
# STEP_TIMEOUT (seconds, default 900) bounds each step, so one hung step cannot take a lease's
# time from the others; a step stopped by it exits 124.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
out="${1:-runs/gpu-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$out"
unset NUMBA_ENABLE_CUDASIM
export CUPY_TF32=0 NVIDIA_TF32_OVERRIDE=0
py="${PYTHON:-python}"
step_timeout="${STEP_TIMEOUT:-900}"
summary="$out/summary.md"
status=0

step() {  # step NAME COMMAND...: run it, keep its log, remember its exit status
    local name="$1"
    shift
    echo "== $name: $*" | tee "$out/$name.log"
    timeout "$step_timeout" "$@" >>"$out/$name.log" 2>&1
    local rc=$?
    echo "   exit $rc" | tee -a "$out/$name.log"
    [ "$rc" -eq 0 ] || status=1
    printf '%s\n' "$rc" >"$out/$name.rc"
}

"$py" - >"$out/device.txt" 2>&1 <<'PY'
from numba import cuda
d = cuda.get_current_device()
print(d.name.decode() if isinstance(d.name, bytes) else d.name, "compute capability", d.compute_capability)
PY
# STEPS picks and orders the steps, each NAME or NAME:SECONDS (its own timeout), e.g. for a short lease:
#     STEPS="gpt_step:120 gpt_nanogpt:150 cuda_suite:240" bash bench/gpu_all.sh $OUT/gpu
# LEASE=1 runs the steps that fit one ten-minute call of a lent machine, most precious first (each step's own
# timeout in seconds): the GPT step's figures (tokens/s, GPU busy, launches from Python) at both shapes, the
# graphs' gain, then the CUDA sub-suite.
# PYTEST_ARGS adds to the suite's pytest line (e.g. "-n 8" where pytest-xdist is there, to compile in parallel).
lease_steps="gpt_step:130 gpt_nanogpt:150 gpt_step_no_graphs:80 cuda_suite:200"
[ "${LEASE:-0}" = 1 ] && [ -z "${STEPS:-}" ] && STEPS="$lease_steps"
all_steps="cuda_suite gemm_vs_cublas cublaslt gemm_variant_3 gemm_variant_4 mlp_step gpt_step gpt_step_no_arena gpt_step_no_graphs gpt_nanogpt gpt_dropout gpt_flash gpt_bf16 gpt2_small_bf16 sass_report"
ran=""
read -ra pytest_extra <<<"${PYTEST_ARGS:-}"
for spec in ${STEPS:-$all_steps}; do
    name="${spec%%:*}"
    secs="$step_timeout"
    [ "$spec" = "$name" ] || secs="${spec#*:}"
    case "$name" in
        cuda_suite) cmd=(env HPCTRAIN_SUBSUITE=cuda "$py" -m pytest -q -p no:cacheprovider -rf "${pytest_extra[@]}" tests/cuda) ;;
        gemm_vs_cublas) cmd=("$py" bench/bench_cuda_gemm.py --shapes gpt-char) ;;
        cublaslt) cmd=("$py" bench/bench_cublaslt.py) ;;
        gemm_variant_3) cmd=("$py" bench/history/cuda_gemm_3_regblock.py --tiles "128,128,8,8,8" --sizes 4096) ;;
        gemm_variant_4) cmd=("$py" bench/history/cuda_gemm_4_pipelined.py) ;;
        mlp_step) cmd=("$py" bench/bench_cuda_step.py) ;;
        gpt_step) cmd=("$py" bench/bench_gpt.py --backend cuda --torch-python "$py" --profile 5) ;;
        gpt_step_no_arena) cmd=("$py" bench/bench_gpt.py --backend cuda --torch-python "$py" --set cuda.arena=false) ;;
        gpt_step_no_graphs) cmd=("$py" bench/bench_gpt.py --backend cuda --torch-python "$py" --set cuda.graphs=false) ;;
        gpt_nanogpt) cmd=("$py" bench/bench_gpt.py --backend cuda --torch-python "$py" --n-layer 6 --n-embd 384
                          --n-head 6 --block-size 256 --batch 64 --steps 5 --repeats 3 --profile 3) ;;
        gpt_dropout) cmd=("$py" bench/bench_gpt.py --backend cuda --torch-python "$py" --n-layer 6 --n-embd 384
                          --n-head 6 --block-size 256 --batch 64 --steps 5 --repeats 3 --dropout 0.2) ;;
        gpt_flash) cmd=("$py" bench/bench_gpt.py --backend cuda --torch-python "$py" --n-layer 6 --n-embd 384
                        --n-head 6 --block-size 256 --batch 64 --steps 5 --repeats 3 --attention flash) ;;
        gpt_bf16) cmd=("$py" bench/bench_gpt.py --backend cuda --torch-python "$py" --n-layer 6 --n-embd 384
                       --n-head 6 --block-size 256 --batch 64 --steps 5 --repeats 3 --precision bf16) ;;
        gpt2_small_bf16) cmd=("$py" bench/bench_gpt.py --backend cuda --torch-python "$py" --n-layer 12 --n-embd 768
                              --n-head 12 --block-size 1024 --batch 8 --steps 3 --repeats 3 --precision bf16
                              --set model.vocab_size=50304) ;;
        sass_report) cmd=("$py" bench/cuda_sass_report.py) ;;
        *) echo "gpu_all.sh: no step named $name (steps: $all_steps)" >&2; exit 2 ;;
    esac
    step_timeout="$secs" step "$name" "${cmd[@]}"
    ran="$ran $name"
done

{
    echo "# GPU figures, $(date -u +%Y-%m-%d) on $(cat "$out/device.txt")"
    echo
    echo "| step | exit | result |"
    echo "|---|---|---|"
    row() { case " $ran " in *" $1 "*) echo "| $1 | $(cat "$out/$1.rc") | $2 |" ;; esac; }
    row cuda_suite "$(grep -E '[0-9]+ (passed|failed)' "$out/cuda_suite.log" | tail -1)"
    row gemm_vs_cublas "$(grep -E '^target|library/cuBLAS' "$out/gemm_vs_cublas.log" | grep -E 'target|4096' | tr '\n' ';')"
    row cublaslt "$(grep -E '^(summary|FAIL|bench_cublaslt:.*nothing)' "$out/cublaslt.log" | tr '\n' ';')"
    row gemm_variant_3 "$(grep -E 'M=N=K= *4096' "$out/gemm_variant_3.log" | tr '\n' ';')"
    row gemm_variant_4 "$(grep -E 'M=N=K= *4096' "$out/gemm_variant_4.log" | tr '\n' ';')"
    row mlp_step "$(grep -E '^(MLP|PyTorch|target)' "$out/mlp_step.log" | tr '\n' ';')"
    # per model shape: tokens/s against PyTorch, GPU busy (profile), launches from Python and graph replays
    row gpt_step "$(grep -E '^(hpctrain|PyTorch|ratio|profile|last step|graphs)' "$out/gpt_step.log" | tr '\n' ';')"
    row gpt_step_no_graphs "$(grep -E '^(hpctrain|ratio|last step|graphs)' "$out/gpt_step_no_graphs.log" | tr '\n' ';')"
    row gpt_nanogpt "$(grep -E '^(hpctrain|PyTorch|ratio|profile|last step|graphs)' "$out/gpt_nanogpt.log" | tr '\n' ';')"
    row gpt_dropout "$(grep -E '^(hpctrain|PyTorch|ratio)' "$out/gpt_dropout.log" | tr '\n' ';')"
    row gpt_flash "$(grep -E '^(hpctrain|PyTorch|ratio)' "$out/gpt_flash.log" | tr '\n' ';')"
    row gpt_bf16 "$(grep -E '^(hpctrain|PyTorch|ratio|mfu|check|  after)' "$out/gpt_bf16.log" | tr '\n' ';')"
    row gpt2_small_bf16 "$(grep -E '^(hpctrain|PyTorch|ratio|mfu|last step|graphs)' "$out/gpt2_small_bf16.log" | tr '\n' ';')"
    row sass_report "$(grep -E '^GEMM targets' "$out/sass_report.log")"
} >"$summary"
cat "$summary"
exit "$status"
