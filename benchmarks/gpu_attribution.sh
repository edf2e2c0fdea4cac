#!/bin/bash
# Issue 44's attribution run on the GPU machine: benchmarks/hf_tp_profile.py at each world size
# in PROFILE_WORLDS (default "2"), time-boxed, results and a tarball of rank traces to $OUT.
# From the repo root, with .whl/ and .gpu-carry/ carried (see benchmarks/README.md):
#     PROFILE_WORLDS="2 4" PROFILE_ARGS_2="--only ..." bash benchmarks/gpu_attribution.sh
LOG="${OUT:-/tmp/out}/attribution.log"
STEP_TAIL=${STEP_TAIL:-45}
source benchmarks/gpu_env.sh
python3 -c "import torch, passkit, passkit_fusion, flashinfer, transformers; print('torch', torch.__version__, 'flashinfer', flashinfer.__version__, 'transformers', transformers.__version__, 'GPUs', torch.cuda.device_count())" | tee -a "$LOG"
for W in ${PROFILE_WORLDS:-2}; do
  extra_var="PROFILE_ARGS_$W"
  limit_var="PROFILE_LIMIT_$W"
  step "${!limit_var:-${PROFILE_LIMIT:-280}}" python3 benchmarks/hf_tp_profile.py --world "$W" --out "$OUT/profile_w$W" \
    --trace-dir "/tmp/traces/w$W" ${PROFILE_ARGS:-} ${!extra_var:-}
done
[ -d /tmp/traces ] && tar czf "$OUT/traces.tgz" -C /tmp traces && ls -la "$OUT"
