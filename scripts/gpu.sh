#!/usr/bin/env bash
# GPU runner for the device machine (torch + CUDA there, no DeepSpeed/pydantic/hjson, no network).
# Installs the wheels carried in .whl/ (made here by `bash scripts/device-wheels.sh`) and
# builds DeepSpeed's JIT ops once (FusedAdam, DeepCompile), then runs what is asked, writing logs and
# results under $OUT:
#   bash scripts/gpu.sh tests [PYTEST ARGS] the GPU-marked tests (launcher runs, residency races, env), 8 at
#                                          a time (1 rank per GPU; 2-GPU cases skip on one GPU), or the
#                                          tests ARGS name
#   bash scripts/gpu.sh worker MODE [ARGS] one bench mode, one rank, in the foreground, its whole log in $OUT
#   bash scripts/gpu.sh bench [ARGS]       deepspeed-offload bench (--plot, --timeline added), results to $OUT
#   bash scripts/gpu.sh bench-bg [ARGS]    the same, started in its own session (it outlives this call:
#                                          a full bench runs longer than one device call may)
#   bash scripts/gpu.sh bench-wait SECS    wait up to SECS for it, then copy its results to $OUT
#   bash scripts/gpu.sh run CMD [ARGS]     any command with the wheels installed and the JIT ops built
#   bash scripts/gpu.sh queue FILE         the jobs of FILE (one `gpu.sh` command line each: tests, bench,
#                                          run ...) one after another in a session of their own, each with
#                                          its own output folder under /tmp/gpu_queue (it outlives this call)
#   bash scripts/gpu.sh queue-wait SECS    wait up to SECS for the queue, then copy what it wrote to $OUT
# bench and bench-bg start afresh unless ARGS hold --resume (then the modes the last bench.json of this
# machine measured with the same arguments are kept; results are written after every mode), or begin
# with --resume-from FILE: a bench.json brought back from an earlier machine (copy it into the repo
# under an ignored path, e.g. out/, and carry that path), the modes it measured are kept.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
# outside the repo: survives between calls on a machine still held; BENCH_DIR names another, so that two
# benches can run side by side (one per GPU, CUDA_VISIBLE_DEVICES set by the caller)
BG=${BENCH_DIR:-/tmp/ds_offload_bench}
mkdir -p "$OUT" "$BG"
# once per machine: a second install (bench-wait, say) would replace packages a running bench is importing
if [ "$(cat /tmp/site/.wheels 2>/dev/null)" != "$(ls .whl)" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    ls .whl > /tmp/site/.wheels
fi
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# One build dir for every process here, outside the repo (the tests' own private dir is for CI).
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, deepspeed; print("torch", torch.__version__, "deepspeed", deepspeed.__version__, "gpus", torch.cuda.device_count())'

build_ops() {  # before anything runs in parallel: no two processes race to build one op
    local t=$SECONDS
    python3 -c 'from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load()' &
    python3 -c 'from deepspeed.ops.op_builder import DeepCompileBuilder; DeepCompileBuilder().load()' &
    wait
    echo "JIT ops built in $((SECONDS - t)) s"
}

collect() {  # at most 8 files come back from a device call: each bench's results, charts and logs as one archive
    tar czf "$OUT/$(basename "$BG").tgz" -C "$BG" . 2>/dev/null
}

prepare_bench() {  # sets BENCH_ARGS; clears $BG unless this run resumes
    local resume=0 from=
    if [ "${1:-}" = --resume-from ]; then
        [ -f "${2:-}" ] || { echo "--resume-from: no file '${2:-}'" >&2; exit 2; }
        from=$2
        shift 2
        set -- "$@" --resume
    fi
    for a in "$@"; do [ "$a" = --resume ] && resume=1; done
    [ $resume = 1 ] && [ -z "$from" ] || rm -f "$BG"/*
    [ -z "$from" ] || cp "$from" "$BG/bench.json"
    # --out first: bench-wait finds the run by it
    BENCH_ARGS=(--out "$BG/bench.json" --plot "$BG/bench.png" --timeline "$BG/timeline.png" "$@")
}

what=${1:-tests}
shift || true
case $what in
tests)
    build_ops
    # CI runs the unit tests on the CPU; with them this did not finish in 400 s on the H200
    # -v: each test's outcome is a line of tests.log as it ends, so a log cut off mid-run (the machine
    # taken back) still names the failures so far, and failures.log holds their reports (tests/conftest.py);
    # the tail shows the summary
    pytest_run() {
        DS_OFFLOAD_FAILURES_LOG=$OUT/failures.log \
            python3 -m pytest -v -rfEs -p no:cacheprovider --basetemp=/tmp/pytest --durations=15 "$@" 2>&1 \
            | tee -a "$OUT/tests.log" | grep -v " PASSED \| SKIPPED " | tail -60
        return "${PIPESTATUS[0]}"
    }
    [ $# -eq 0 ] || { pytest_run "$@"; exit; }
    # 8 at a time on a shared GPU (each test launches its own processes): a failure seen only here,
    # run it again alone (`gpu.sh tests TEST`) before reading it as a regression
    pytest_run tests/e2e tests/unit/test_residency.py tests/unit/test_env.py -n 8 -m "gpu or gpu2 or anyaccel"
    exit ;;
worker)
    build_ops
    mode=$1; shift
    python3 -m deepspeed_offload.bench --worker "$mode" "$@" >"$OUT/worker-$mode.log" 2>&1
    echo "worker $mode: rc $?"; grep -a "RESULT\|Error\|error" "$OUT/worker-$mode.log" | tail -8 ;;
bench)
    build_ops
    prepare_bench "$@"
    python3 -m deepspeed_offload.bench "${BENCH_ARGS[@]}" 2>&1 | tee "$BG/bench.log" | tail -40
    collect ;;
bench-bg)
    build_ops
    prepare_bench "$@"
    setsid nohup python3 -m deepspeed_offload.bench "${BENCH_ARGS[@]}" >>"$BG/bench.log" 2>&1 < /dev/null &
    echo "bench started in the background, pid $!" ;;
run)
    build_ops
    "$@" ;;
queue)
    build_ops
    Q=/tmp/gpu_queue
    rm -rf "$Q"; mkdir -p "$Q"
    cp "$1" "$Q/jobs"
    # each job: its own OUT and BENCH_DIR, its exit status and time in the queue's log
    setsid nohup bash -c '
        k=0
        while IFS= read -r job; do
            [ -z "$job" ] && continue
            k=$((k + 1)); d='"$Q"'/job$k; mkdir -p "$d"
            echo "$(date +%T) start job$k: $job" >> '"$Q"'/queue.log
            t=$SECONDS
            OUT="$d" BENCH_DIR="$d/bench" bash scripts/gpu.sh $job > "$d/log" 2>&1
            rc=$?  # (read before the line below: its $(date) would set $? to its own)
            echo "$(date +%T) end job$k: rc $rc in $((SECONDS - t)) s" >> '"$Q"'/queue.log
        done < '"$Q"'/jobs
        echo done >> '"$Q"'/queue.log' > /dev/null 2>&1 < /dev/null &
    echo "queue started: $(grep -c . "$Q/jobs") job(s)" ;;
queue-wait)
    Q=/tmp/gpu_queue
    # a fresh machine (the one that ran the queue went back between two calls) has none: say so at once
    [ -f "$Q/jobs" ] || { echo "queue-wait: no queue on this machine (started afresh: the queue is gone)"; exit 3; }
    end=$((SECONDS + ${1:-560}))
    while ! grep -qx done "$Q/queue.log" 2>/dev/null && [ $SECONDS -lt $end ]; do sleep 5; done
    cat "$Q/queue.log"
    tar czf "$OUT/queue.tgz" -C "$Q" . 2>/dev/null
    ls -la "$OUT" ;;
bench-wait)
    end=$((SECONDS + ${1:-560}))
    while pgrep -f "deepspeed_offload.bench --out $BG" >/dev/null && [ $SECONDS -lt $end ]; do sleep 5; done
    pgrep -f "deepspeed_offload.bench --out $BG" >/dev/null && echo "bench still running" || echo "bench finished"
    collect
    tail -40 "$BG/bench.log" ;;
*)
    echo "usage: bash scripts/gpu.sh tests|worker|bench|bench-bg|bench-wait|run [ARGS]" >&2; exit 2 ;;
esac
