# Sourced by gpu_session.sh and gpu_gate.sh on the GPU machine (LOG names the log file):
# installs the carried wheels (.whl/, and .whl-hf/ when carried), activates the staged flashinfer (.gpu-carry/), refuses
# to go on with NVLink multicast on, and defines `step LIMIT CMD...` (time-boxed, logged).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG=${LOG:-$OUT/gpu.log}
# once per machine: a second sourcing while programs run must not rewrite their files
[ -f /tmp/site/.passkit-installed ] || { python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && touch /tmp/site/.passkit-installed; } || exit 1
# .whl-hf/ (optional): the transformers the project tests with and what it checks at import,
# over the image's older one (whose TP plans break graphs at every module: see docs)
# (a *.tar.gz there is unpacked over it: a package slimmed to fit the carry, as the staged flashinfer is)
[ ! -d .whl-hf ] || [ -f /tmp/site/.hf-installed ] || { python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl-hf/*.whl \
  && for t in .whl-hf/*.tar.gz; do [ ! -f "$t" ] || tar xzf "$t" -C /tmp/site || exit 1; done && touch /tmp/site/.hf-installed; } || exit 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PATH=/tmp/site/bin:$PATH
source .gpu-carry/activate.sh
[ "${NCCL_NVLS_ENABLE:-}" = 0 ] || { echo "multicast must be off"; exit 1; }
step() { local limit=$1; shift; echo "=== $* (limit ${limit}s)" | tee -a "$LOG"; local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG" | tail -n "${STEP_TAIL:-40}"; echo "=== rc=${PIPESTATUS[0]} in $((SECONDS - t0))s" | tee -a "$LOG"; }
nvidia-smi -L | tee -a "$LOG"
nvidia-smi topo -m 2>&1 | head -12 | tee -a "$LOG"  # NVLink or PCIe between the GPUs: the collectives' costs differ
