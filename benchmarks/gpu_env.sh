# Sourced by gpu_session.sh, gpu_gate.sh and gpu_attribution.sh on the GPU machine, from the
# repository root (LOG names the log file, OUT the results folder). It
#   * installs passkit, passkit-fusion (with flashinfer and the Hugging Face extras) and
#     passkit-testing: from the package index by default (an ordinary GPU machine with a CUDA
#     torch), or, where benchmarks/stage_offline.sh staged them (.gpu-carry/ present, or
#     GPU_STAGED=DIR), from the staged folders with no index at all;
#     GPU_ENV_INSTALL=0 skips installing (an environment already set up);
#   * keeps NVLink multicast off, as every committed result was measured, and refuses to go
#     on if it was turned on;
#   * defines `step LIMIT CMD...`: CMD time-boxed to LIMIT seconds, its output logged.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG=${LOG:-$OUT/gpu.log}
STAGED=${GPU_STAGED:-}
[ -n "$STAGED" ] || [ ! -f .gpu-carry/activate.sh ] || STAGED=.gpu-carry
if [ "${GPU_ENV_INSTALL:-1}" = 0 ]; then
  :
elif [ -n "$STAGED" ]; then
  # offline: the wheels of .whl/ (and .whl-hf/) into /tmp/site, once per machine (a second
  # sourcing while programs run must not rewrite their files), then the staged flashinfer
  [ -f /tmp/site/.passkit-installed ] || { python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && touch /tmp/site/.passkit-installed; } || exit 1
  # .whl-hf/ (optional): the transformers the project tests with, over an image's older one
  # (a *.tar.gz there is unpacked over it: a package slimmed to travel, as flashinfer is)
  [ ! -d .whl-hf ] || [ -f /tmp/site/.hf-installed ] || { python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl-hf/*.whl \
    && for t in .whl-hf/*.tar.gz; do [ ! -f "$t" ] || tar xzf "$t" -C /tmp/site || exit 1; done && touch /tmp/site/.hf-installed; } || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  export PATH=/tmp/site/bin:$PATH
  source "$STAGED/activate.sh"
elif ! python3 -c "import os, sys, passkit, passkit_fusion, passkit_testing, flashinfer, xdist
sys.exit(os.path.dirname(os.path.realpath(passkit.__file__)) != os.path.realpath('passkit'))" 2>/dev/null; then
  # online (unless this checkout is installed already): editable installs beside the
  # environment's CUDA torch, flashinfer from the index
  python3 -m pip install -q -e . -e "./passkit_fusion[flashinfer,hf]" -e ./passkit_testing "pytest>=8" pytest-xdist || exit 1
fi
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
[ "$NCCL_NVLS_ENABLE" = 0 ] || { echo "multicast must be off (NCCL_NVLS_ENABLE=0): the results were measured so"; exit 1; }
step() { local limit=$1; shift; echo "=== $* (limit ${limit}s)" | tee -a "$LOG"; local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG" | tail -n "${STEP_TAIL:-40}"; echo "=== rc=${PIPESTATUS[0]} in $((SECONDS - t0))s" | tee -a "$LOG"; }
nvidia-smi -L | tee -a "$LOG"
nvidia-smi topo -m 2>&1 | head -12 | tee -a "$LOG"  # NVLink or PCIe between the GPUs: the collectives' costs differ
