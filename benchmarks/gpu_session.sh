#!/usr/bin/env bash
# One GPU session's checks and measurements in one command: the GPU tests of the kernels,
# then the benchmark runs the performance docs quote, each with a time limit so that the
# whole fits one call of about ten minutes. Logs and tables go to OUT_DIR.
#
#     bash benchmarks/gpu_session.sh OUT_DIR [SECONDS]    # on the GPU machine, repo root
#     bash benchmarks/gpu_session.sh --quick OUT_DIR      # tiny sizes on a CPU, tests
#                                                         # collected only
#
# SECONDS (default 560) is the whole run's budget; the steps share it in the order below
# and a step that would start with under 20 s left is skipped (the log says so). The
# logs and tables are written under OUT_DIR/work and packed at the end into
# OUT_DIR/session.tgz (the device tool brings back a few files only).
# Packages the machine lacks (funsor with makefun; arviz; tokamax with its requirements,
# for its rows, if wanted) are installed from the wheels in .wheels-gpu/ when that folder
# exists
# (`pip install --no-deps --target`, put first on PYTHONPATH).
#
# Steps, the measurements still open first: the model path's forward overhead over the
# bare cuDNN call, split (`benchmarks/gpu.py` at n = 4096: dense, causal, window against
# `cudnn`, `cudnn-residual` and `cudnn-as-ours`, the call structinfer makes); the peers on
# per-parent bias, block-sparse and geometric at n = 4096 and on causal and window at
# n = 16384; then the whole `pytest -m gpu`, spread over several processes (pytest-xdist,
# JAX's GPU memory allocated as needed, not preallocated per process).
set -uo pipefail
quick=0
if [ "${1:-}" = "--quick" ]; then quick=1; shift; fi
dest="${1:?usage: gpu_session.sh [--quick] OUT_DIR [SECONDS]}"
budget="${2:-560}"
mkdir -p "$dest" && dest="$(cd "$dest" && pwd)"  # a relative OUT_DIR: the caller's
cd "$(dirname "$0")/.."
out="$dest/work"
mkdir -p "$out"
py="${PYTHON:-python3}"
start=$SECONDS
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.6}"

if [ -d .wheels-gpu ] && ls .wheels-gpu/*.whl > /dev/null 2>&1; then
  if "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/structinfer-site .wheels-gpu/*.whl > "$out/wheels.log" 2>&1; then
    export PYTHONPATH="/tmp/structinfer-site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "installing .wheels-gpu/ failed (wheels.log); going on without them"
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null
  "$py" -c "import jax, jaxlib, numpyro, funsor; print('jax', jax.__version__, 'jaxlib', \
jaxlib.__version__, 'numpyro', numpyro.__version__, 'funsor', funsor.__version__); \
print(jax.devices())"
  "$py" -c "import torch; print('torch', torch.__version__)" 2>/dev/null || echo "no torch"
  git log -1 --format='commit %H' 2>/dev/null
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

# step NAME MAX_SECONDS COMMAND...: run COMMAND with its output in $out/NAME.log, for at
# most MAX_SECONDS or what is left of the budget
step() {
  local name="$1" limit="$2"
  shift 2
  local left=$((budget - (SECONDS - start)))
  if [ "$left" -lt 20 ]; then
    echo "== $name: skipped (budget: ${left}s left)" | tee -a "$out/steps.log"
    return
  fi
  [ "$limit" -gt "$left" ] && limit="$left"
  echo "== $name (at most ${limit}s): $*" | tee -a "$out/steps.log"
  local t0=$SECONDS
  timeout --signal=INT --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0))s" | tee -a "$out/steps.log"
  tail -n 25 "$out/$name.log"
}

pytest=("$py" -m pytest -q -m gpu -p no:cacheprovider)
if [ "$quick" = 1 ]; then
  pytest+=(--collect-only)  # a CPU runs the kernels' tests in the suite already
  q=(--quick)
  sizes4k=(--sizes 128 --heads 2)
  sizes16k=(--sizes 256 --heads 2)
else
  pytest+=(-n "${GPU_TEST_WORKERS:-6}" --timeout 300)
  q=()
  sizes4k=(--sizes 4096 --heads 32)
  sizes16k=(--sizes 16384 --heads 16)
fi

step overhead 100 "$py" benchmarks/gpu.py "${q[@]}" "${sizes4k[@]}" \
  --cases dense causal window --modes fwd \
  --impls structinfer cudnn cudnn-residual cudnn-as-ours torch-sdpa \
  --budget-seconds 80 --out "$out/overhead"
step peers_4096 130 "$py" benchmarks/gpu.py "${q[@]}" "${sizes4k[@]}" \
  --cases bias block_sparse geometric --impls structinfer torch-sdpa torch-flex cudnn \
  --budget-seconds 110 --out "$out/peers"
step peers_16384 90 "$py" benchmarks/gpu.py "${q[@]}" "${sizes16k[@]}" \
  --cases causal window --impls structinfer cudnn torch-sdpa torch-flex \
  --budget-seconds 70 --out "$out/peers16k"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # several test processes share the GPU
step gpu_suite 600 "${pytest[@]}" tests
echo "total: $((SECONDS - start))s" | tee -a "$out/steps.log"
tar czf "$dest/session.tgz" -C "$dest" work && cp "$out/steps.log" "$dest/"
