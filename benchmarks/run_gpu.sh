#!/usr/bin/env bash
# Everything that needs a GPU, in one go: first steps of each compile path in fresh processes
# (tests and timings), the GPU-marked tests of fp8conf, the conformance
# suite on CUDA (NUM-004 included), its structural areas (PROV, VAL, EMU, REG, BND) with the
# models themselves on CUDA (--fp8-device=cuda) for both in-tree backends, where 2 GPUs exist the
# GraphPP pipeline over NCCL and its benchmark (bench_pipeline.py), and the goal table's rows
# (bench_compile.py, bench_precompile.py), first step against depth beside torch's own paths
# (bench_depth.py), and where a deep model's steady step goes (profile_steady.py). Runs from the
# repository root on a machine with CUDA, torch and torchao installed (fp8conf itself need not be
# installed):
#
#   benchmarks/run_gpu.sh                      every part, in order
#   benchmarks/run_gpu.sh goals_start moe      only the parts named (listed at the end)
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Bytecode caching on where the machine turns it off: without it each process compiles the source
# of every torch module it imports again, seconds that would land in the benchmarks' process times.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-/tmp/fp8conf-pycache}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/fp8conf-inductor}"
OUT="${OUT:-/tmp/fp8conf-gpu}"
mkdir -p "$OUT"
python3 - <<'PY'
import torch, torchao
print(f"torch {torch.__version__}, torchao {torchao.__version__}, device {torch.cuda.get_device_name()}, "
      f"capability {torch.cuda.get_device_capability()}")
PY

fresh() {
    # First, as a trainer meets them: each public compile path's first steps of a Llama-shaped model
    # in a process of its own with an empty Inductor cache (tests/test_fresh_process.py), then each
    # compiled variant's first step timed the same way (bench_compile.py --fresh).
    python3 -m pytest -p conformance.plugin -p no:cacheprovider -q -W ignore -n 4 -m fp8_gpu \
        tests/test_fresh_process.py 2>&1 | tee "$OUT/fresh-process-tests.log" | tail -n 15
    python3 benchmarks/bench_compile.py --fresh --jsonl "$OUT/fresh.jsonl" 2>&1 | tee "$OUT/bench-fresh.log" | grep -E "^depth|^\|"
}

pipeline() {
    if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
        export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
        # One zero-bubble (I/W apart) and one looped multi-stage schedule, eager and regionally
        # compiled, over NCCL; then the same zero-bubble step over gloo on the same host.
        for schedule in "--schedule ZBVZeroBubble --stages-per-rank 2" "--schedule Interleaved1F1B --stages-per-rank 2"; do
            for mode in "" "--compile regional"; do
                python3 -m fp8conf.pipeline --backend nccl --ranks 2 $schedule $mode 2>&1 | tee -a "$OUT/pipeline-nccl.log" | grep "pipeline over"
            done
        done
        # (V-shaped schedules cannot start over gloo on torch 2.11, which fp8conf refuses up front.)
        python3 -m fp8conf.pipeline --backend gloo --ranks 2 --schedule ZBVZeroBubble 2>&1 | tee -a "$OUT/pipeline-nccl.log" \
            | grep -E "pipeline over|cannot start over gloo"
        # Every checked schedule over NCCL, eager and regionally compiled, 4 microbatches, for the FP8
        # block stack and the Llama-shaped model, tensorwise and rowwise: gradients against the
        # unsplit step, step times and each rank's idle share (torch.profiler). One table per model.
        for model in stack llama; do
            python3 benchmarks/bench_pipeline.py --backend nccl --ranks 2 --models $model --recipes tensorwise rowwise \
                --compile eager regional --microbatches 4 --dim 1024 --tokens 1024 --repeats 3 \
                2>&1 | tee "$OUT/bench-pipeline-nccl-$model.log" | grep "^|"
        done
    else
        echo "one GPU: the NCCL pipeline needs 2 (nvidia-h200-x2)"
    fi
}

gpu_tests() {
    python3 -m pytest -p conformance.plugin -p no:cacheprovider -q -W ignore \
        -m "fp8_gpu or fp8_sm89 or fp8_sm90 or fp8_sm100" tests/test_passes.py tests/test_e8m0_op.py tests/test_mx.py \
        tests/test_grouped.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -n 15
}

conformance() {
    python3 -m pytest -p conformance.plugin -p no:cacheprovider -q -W ignore \
        --fp8-backend=conformance.backends.reference:ReferenceBackend --hypothesis-profile=fp8conf-ci \
        --fp8-report="$OUT/conformance-gpu.json" -n 8 conformance/properties \
        2>&1 | tee "$OUT/conformance-gpu.log" | tail -n 45
    # The structural areas with models built, traced and checked on CUDA (--fp8-device=cuda): a
    # backend whose passes only look at CUDA nodes is judged there.
    STRUCTURAL="conformance/properties/test_provenance.py conformance/properties/test_validation.py conformance/properties/test_emulation.py conformance/properties/test_regions.py conformance/properties/test_graphpp.py"
    for backend in conformance.backends.reference:ReferenceBackend conformance.backends.makefx:MakeFxBackend; do
        name="${backend##*:}"
        python3 -m pytest -p conformance.plugin -p no:cacheprovider -q -W ignore \
            --fp8-backend="$backend" --fp8-device=cuda --hypothesis-profile=fp8conf-ci \
            --fp8-report="$OUT/structural-cuda-$name.json" -n 8 $STRUCTURAL \
            2>&1 | tee "$OUT/structural-cuda-$name.log" | tail -n 25
    done
}

moe() {
    # FP8 grouped experts (MOE) with the models on CUDA: MOE-006/007 then run real FP8 experts and
    # MOE-008 compiles them; MOE-008's mutant and MOE-006's second-API one must fail them; then the
    # MoE benchmark.
    python3 -m pytest -p conformance.plugin -p no:cacheprovider -q -W ignore \
        --fp8-backend=conformance.backends.reference:ReferenceBackend --fp8-device=cuda --hypothesis-profile=fp8conf-ci \
        --fp8-report="$OUT/moe-cuda.json" conformance/properties/test_moe.py 2>&1 | tee "$OUT/moe-cuda.log" | tail -n 15
    PYTHONPATH="$PWD/tests:$PYTHONPATH" python3 -m pytest -p conformance.plugin -p no:cacheprovider -q -W ignore \
        --fp8-backend=mutants.moe:RegionalCompileDropsGroupedScales --fp8-device=cuda --hypothesis-profile=fp8conf-mutants \
        -k test_MOE_008_ conformance/properties/test_moe.py 2>&1 | tee "$OUT/moe-mutant-cuda.log" | tail -n 8
    # A defect in experts on the second grouped API only: MOE-006 must fail where it runs them.
    PYTHONPATH="$PWD/tests:$PYTHONPATH" python3 -m pytest -p conformance.plugin -p no:cacheprovider -q -W ignore \
        --fp8-backend=mutants.moe:V2SharedGroupScales --fp8-device=cuda --hypothesis-profile=fp8conf-mutants \
        -k test_MOE_006_ conformance/properties/test_moe.py 2>&1 | tee "$OUT/moe-v2-mutant-cuda.log" | tail -n 8
    python3 benchmarks/bench_moe.py --jsonl "$OUT/moe.jsonl" 2>&1 | tee "$OUT/bench-moe.log" | tail -n 24
}

doctor() {
    # The versions, the device and each fast path's state (on, or off with the reason) here.
    python3 -m fp8conf.tools.cli doctor 2>&1 | tee "$OUT/doctor.log"
}

sharded() {
    # The data-parallel FP8 step over NCCL, one GPU per rank (all of this machine's GPUs, at most
    # 2): float8 all-gather on and off, gradients against the unsharded step, regionally compiled.
    ranks=$(python3 -c 'import torch; print(min(2, torch.cuda.device_count()))')
    python3 -m fp8conf.tools.sharded_check --backend nccl --ranks "$ranks" --dim 1024 --tokens 1024 --compile regional \
        2>&1 | tee "$OUT/sharded-nccl.log" | grep -E "^data-parallel|Error"
}

goals_start() {
    # The goal rows about starting (docs/performance.md, benchmarks/goal_rows.jsonl): cold start at 2 and 32 blocks
    # and the first step at the debug shape (each row a fresh process with empty caches), then the
    # warm start from a regional artifact against a cold regional compile.
    python3 benchmarks/bench_compile.py --depth 2 32 --depth-variants "fp8conf regional" "torch.compile" --depth-repeats 1 \
        --budget 560 2>&1 | tee "$OUT/goals-depth.log" | grep -E "^\|"
    python3 benchmarks/bench_compile.py --depth 6 --depth-variants "fp8conf regional" "torch.compile" --depth-repeats 2 \
        2>&1 | tee "$OUT/goals-debug-first-step.log" | grep -E "^\|"
    python3 benchmarks/bench_precompile.py --repeats 3 --caches empty 2>&1 | tee "$OUT/goals-warm-start.log" | grep -E "^\|"
}

goals_steady() {
    # The goal rows about steps: throughput and peak memory against torch.compile at the debug shape
    # and at dim 2048 x 4 (interleaved rounds), and regional + CUDA graphs at the debug shape.
    python3 benchmarks/bench_compile.py --configs dim256x6 dim2048x4 --variants "torch.compile" "fp8conf full" \
        "fp8conf regional" --repeats 7 --iters 50 2>&1 | tee "$OUT/goals-throughput.log" | grep -E "^\|"
    python3 benchmarks/bench_compile.py --configs dim256x6 --variants "torch.compile" "fp8conf regional + CUDA graphs" \
        --repeats 3 2>&1 | tee "$OUT/goals-cudagraphs.log" | grep -E "^\|"
}

depth() {
    # First step against depth (issue 61): fp8conf regional and full beside torch.compile, torch.compile
    # with nested_compile_region on the block and regional_inductor on the tagged FP8 regions, each row
    # a fresh process with an empty Inductor cache; rows appended to $OUT/bench_depth.jsonl, then the
    # table and the plot ($OUT/bench_depth.svg) of every row kept so far. All depths and both recipes
    # take more than one 10-minute call: pick them, e.g.
    #   DEPTH_BLOCKS="2 8" benchmarks/run_gpu.sh depth; DEPTH_BLOCKS=32 DEPTH_RECIPES=tensorwise benchmarks/run_gpu.sh depth
    # DEPTH_PATHS picks paths (comma-separated names, e.g. "fp8conf regional,torch.compile"), DEPTH_FFN=experts
    # the grouped-experts model (rowwise only; its rows go to $OUT/bench_depth-experts.jsonl).
    local paths=() ffn="${DEPTH_FFN:-dense}" jsonl="$OUT/bench_depth.jsonl"
    [ -z "${DEPTH_PATHS:-}" ] || { IFS=, read -r -a paths <<<"$DEPTH_PATHS"; paths=(--paths "${paths[@]}"); }
    [ "$ffn" = dense ] || jsonl="$OUT/bench_depth-$ffn.jsonl"
    python3 benchmarks/bench_depth.py --blocks ${DEPTH_BLOCKS:-2 8 32 64} --recipes ${DEPTH_RECIPES:-tensorwise rowwise} \
        --ffn "$ffn" "${paths[@]}" --row-timeout "${DEPTH_ROW_TIMEOUT:-300}" --jsonl "$jsonl" 2>&1 \
        | tee -a "$OUT/bench-depth.log" | grep -E "blocks "
    python3 benchmarks/bench_depth.py --from-jsonl "$jsonl" --ffn "$ffn" 2>&1 | tee -a "$OUT/bench-depth-table.log" \
        | grep -E "^\||^Fitted|^plot"
}

steady() {
    # Where a deep model's steady step goes (issue 61): fp8conf regional, with its blocks repeated,
    # traced whole and replayed as a CUDA graph (the host's share), beside full and torch.compile at
    # 32 blocks, then regional, full and torch.compile at 8 (benchmarks/profile_steady.py: step
    # time, kernel time, launches, allocations, kernels by kind).
    python3 benchmarks/profile_steady.py --blocks 32 --recipe tensorwise --paths "fp8conf regional" \
        "fp8conf regional, whole trace" "fp8conf regional, CUDA graphs" "fp8conf full" "torch.compile" 2>&1 \
        | tee "$OUT/steady-32.log" | grep -E "^\||^ "
    python3 benchmarks/profile_steady.py --blocks 8 --recipe tensorwise \
        --paths "fp8conf regional" "fp8conf full" "torch.compile" 2>&1 | tee "$OUT/steady-8.log" | grep -E "^\||^ "
}

# Parts to run: the arguments (any of doctor fresh pipeline gpu_tests conformance moe sharded
# goals_start goals_steady depth steady), all of them by default. One device command may run for at most 10 minutes: the
# goal rows take about that each, so run them as calls of their own.
ALL="doctor fresh pipeline gpu_tests conformance moe sharded goals_start goals_steady depth steady"
[ $# -gt 0 ] || set -- $ALL
for part in "$@"; do
    case " $ALL " in
        *" $part "*) echo "== $part"; "$part" ;;
        *) echo "run_gpu.sh: unknown part '$part' (parts: $ALL)" >&2; exit 2 ;;
    esac
done
