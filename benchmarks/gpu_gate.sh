#!/bin/bash
# The two-GPU gate: run on every change that touches passes or the backend while a machine
# with 2+ GPUs is at hand. From the repo root on the GPU machine (gpu_env.sh installs what
# it needs from the package index, or from what benchmarks/stage_offline.sh staged on a
# machine without network: benchmarks/README.md, "How to run"):
#     bash benchmarks/gpu_gate.sh                      # every step
#     GATE_STEPS="probe tests" bash benchmarks/gpu_gate.sh   # some (each step is time-boxed,
#     GATE_STEPS="hf e2e" bash benchmarks/gpu_gate.sh        # so a few fit a 10-minute slot)
# Steps: probe (versions, flashinfer JIT build, kernels saved to $OUT), host (the fused op's
# host time per call, benchmarks/op_host_cost.py), tests (tests/gpu at
# GPU_WORLD_SIZE=$GATE_WORLD but the users' order), suite (the whole of tests/gpu as one command,
# SUITE_PARALLEL modules at a time: tests/gpu/conftest.py keeps a module's shared world on one worker), users (tests/gpu/test_users_order_gpu.py:
# each pass set x mode x first call in a fresh program ending with destroy_process_group(),
# USERS_PARALLEL cases at a time with pytest-xdist), control (benchmarks/users_order_control.py:
# the same program ended through passkit's teardown and through torch's alone), hf (benchmarks/hf_tp.py: Hugging Face Llama TP=2, DTensor, tokens
# dynamic, Inductor vs passkit with and without mode="reduce-overhead": sites fused per pass
# and latency per token count), e2e (benchmarks/fusion_e2e.py --world 2), tune (benchmarks/hf_tune.py:
# passkit tune-model on the HF Llama, the decision stored, restored by a fresh program), tuned
# (benchmarks/tuned_e2e.py: tuned vs tabled vs Inductor on the synthetic stacks), coverage (benchmarks/coverage.py --gpu: the families
# at hidden 4096, GPU kernels vs Inductor), stale (flashinfer hidden, then importable, same
# caches: the second start must fuse). Each step is
# time-boxed; the log is $OUT/gate.log (commit it under benchmarks/results/).
LOG=${GATE_LOG:-${OUT:-/tmp/out}/gate.log}
WORLD=${GATE_WORLD:-2}
STEP_TAIL=60
source benchmarks/gpu_env.sh
python3 -c "import torch, passkit, passkit_fusion; print('torch', torch.__version__, 'passkit', passkit.__version__, 'GPUs', torch.cuda.device_count())" | tee -a "$LOG"
for s in ${GATE_STEPS:-probe users tests hf e2e}; do
  case $s in
    probe) step "${PROBE_LIMIT:-330}" python3 benchmarks/gpu_probe.py; [ -z "$STAGED" ] || bash "$STAGED/save-jit.sh" ;;
    host) step "${HOST_LIMIT:-120}" python3 benchmarks/op_host_cost.py --device cuda --world "$WORLD" --out "$OUT/op_host_cost" ${HOST_ARGS:-} ;;
    tests) GPU_WORLD_SIZE=$WORLD step "${TEST_LIMIT:-300}" python3 -m pytest -q -p no:cacheprovider ${TEST_ARGS:-tests/gpu --deselect tests/gpu/test_users_order_gpu.py} ;;
    suite) USERS_ORDER_LOG=$OUT/users_w$WORLD.jsonl GPU_WORLD_SIZE=$WORLD step "${SUITE_LIMIT:-540}" python3 -m pytest -q -p no:cacheprovider -n "${SUITE_PARALLEL:-6}" --dist loadgroup tests/gpu ${SUITE_ARGS:-} ;;
    users) USERS_ORDER_LOG=$OUT/users_w$WORLD.jsonl GPU_WORLD_SIZE=$WORLD step "${USERS_LIMIT:-420}" python3 -m pytest -q -p no:cacheprovider -n "${USERS_PARALLEL:-4}" tests/gpu/test_users_order_gpu.py ${USERS_ARGS:-} ;;
    control) step "${CONTROL_LIMIT:-200}" python3 benchmarks/users_order_control.py --world "$WORLD" ${CONTROL_ARGS:-} ;;
    hf) step "${HF_LIMIT:-420}" python3 benchmarks/hf_tp.py --world "$WORLD" --out "$OUT/hf_tp" ${HF_ARGS:-} ;;
    coverage) step "${COVERAGE_LIMIT:-540}" python3 benchmarks/coverage.py --gpu --jobs "${COVERAGE_JOBS:-3}" --cache "${COVERAGE_CACHE:-$OUT/coverage_runs}" --write-to "$OUT" ${COVERAGE_ARGS:-} ;;
    stale)  # a pass's skip must not outlive its cause: flashinfer hidden at the first start, importable at the second, same caches
      # hidden: a sitecustomize that makes `import flashinfer` fail and find_spec() say None
      mkdir -p /tmp/stale/hide && echo 'import sys; sys.modules["flashinfer"] = None' > /tmp/stale/hide/sitecustomize.py
      for phase in hidden present; do
        path=${PYTHONPATH:-}; [ "$phase" = hidden ] && path=/tmp/stale/hide${path:+:$path}
        PYTHONPATH=$path PASSKIT_CACHE_DIR=/tmp/stale/passkit TORCHINDUCTOR_CACHE_DIR=/tmp/stale/inductor \
          step "${STALE_LIMIT:-240}" python3 benchmarks/coverage.py --gpu --families Llama --write-to "$OUT/stale_$phase"
      done ;;
    e2e) step "${E2E_LIMIT:-200}" python3 benchmarks/fusion_e2e.py --world "$WORLD" --replays "${REPLAYS:-50}" ${E2E_ARGS:-} ;;
    tune) step "${TUNE_LIMIT:-330}" python3 benchmarks/hf_tune.py --world "$WORLD" --out-dir "$OUT" ${TUNE_ARGS:-} ;;
    tuned) step "${TUNED_LIMIT:-300}" python3 benchmarks/tuned_e2e.py --world "$WORLD" ${TUNED_ARGS:-} ;;
    *) echo "unknown gate step $s" | tee -a "$LOG" ;;
  esac
done
