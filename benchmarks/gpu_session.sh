#!/bin/bash
# One GPU-machine session: the GPU tests and the fusion benchmarks, each step time-boxed so
# the whole command ends inside a 10-minute slot. Run from the repo root on
# the GPU machine (gpu_env.sh installs from the package index, or from what
# benchmarks/stage_offline.sh staged for a machine without network):
#     E2E_WORLDS="2 4" OP_WORLDS="4" TEST_WORLDS="2 4" TEST_REPEAT=3 TEARDOWN_WORLDS="2" \
#       bash benchmarks/gpu_session.sh
# Logs and results go to $OUT. NVLink multicast stays off (gpu_env.sh sets the variables).
LOG="${OUT:-/tmp/out}/log.txt"
source benchmarks/gpu_env.sh
python3 -c "import torch, passkit, passkit_fusion, flashinfer; print(torch.__version__, passkit.__version__, flashinfer.__version__, torch.cuda.device_count())" | tee -a "$LOG"
for W in ${E2E_WORLDS:-2}; do
  step "${E2E_LIMIT:-150}" python3 benchmarks/fusion_e2e.py --world "$W" --replays "${REPLAYS:-100}" ${E2E_ARGS:-}
done
for W in ${OP_WORLDS:-}; do
  mkdir -p "$OUT/op_w$W"
  GPU_WORLD_SIZE=$W step "${OP_LIMIT:-150}" python3 benchmarks/fusion_op.py --out "$OUT/op_w$W" --tokens ${OP_TOKENS:-1 4 16 64 256 1024 2048 4096 8192}
done
for W in ${LN_WORLDS:-}; do  # allreduce_layernorm's op benchmark (its verdict: the opt-in gate)
  step "${LN_LIMIT:-240}" python3 benchmarks/allreduce_layernorm.py --world "$W" --out "$OUT/allreduce_layernorm_w$W" ${LN_ARGS:-}
done
for W in ${TEST_WORLDS:-}; do
  for i in $(seq "${TEST_REPEAT:-1}"); do
    GPU_WORLD_SIZE=$W GPU_FAULT_WORLDS=$W step "${TEST_LIMIT:-360}" python3 -m pytest -q -p no:cacheprovider tests/gpu
  done
done
for W in ${TEARDOWN_WORLDS:-}; do
  step "${TEARDOWN_LIMIT:-150}" python3 benchmarks/teardown.py --world "$W" --limit 30 ${TEARDOWN_ARGS:-}
done
