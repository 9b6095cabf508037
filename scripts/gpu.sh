#!/usr/bin/env bash
# GPU runner for the device machine (torch + CUDA there, no DeepSpeed/pydantic/hjson, no network).
# Installs the wheels carried in .whl/ (made here by `bash ../shared/tools/device-wheels.sh`), then
# runs what is asked, writing logs and results under $OUT:
#   bash scripts/gpu.sh tests        GPU-marked tests (1 rank per GPU; 2-GPU cases skip on one GPU)
#   bash scripts/gpu.sh bench [ARGS] deepspeed-offload bench on DESIGN.md's 1.07B model
#   bash scripts/gpu.sh all          both
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, deepspeed; print("torch", torch.__version__, "deepspeed", deepspeed.__version__, "gpus", torch.cuda.device_count())'

what=${1:-all}
shift || true
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
    python3 -m pytest tests -q -rs -m "not e2e or gpu or gpu2 or anyaccel" -p no:cacheprovider --basetemp=/tmp/pytest \
        2>&1 | tee "$OUT/tests.log" | tail -40
    rc=${PIPESTATUS[0]}
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    python3 -m deepspeed_offload.bench --out "$OUT/bench.json" --plot "$OUT/bench.png" "$@" 2>&1 | tee "$OUT/bench.log" | tail -30
fi
exit $rc
