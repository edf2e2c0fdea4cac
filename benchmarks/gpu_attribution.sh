#!/bin/bash
# Where the time goes between passkit and the ceiling (benchmarks/hf_tp_profile.py) on the GPU
# machine, time-boxed, results and a tarball of rank traces to $OUT. From the repo root
# (gpu_env.sh installs what it needs: benchmarks/README.md, "How to run"). Each job is "GPUS:LIMIT_S:NAME:ARGS"; the jobs of one
# PROFILE_JOBS entry (separated by "|") run at once on disjoint GPUs, the entries one after another.
# A job named suite* runs the whole GPU suite (pytest tests/gpu ARGS) at the world size of its GPUs:
#     PROFILE_JOBS="0,1:300:w2:--world 2 --modes graph|2,3:300:w2_8l:--world 2 --layers 8;0,1,2,3:200:w4:--world 4 --modes graph" \
#       bash benchmarks/gpu_attribution.sh
LOG="${OUT:-/tmp/out}/attribution.log"
STEP_TAIL=${STEP_TAIL:-45}
source benchmarks/gpu_env.sh
python3 -c "import torch, passkit, passkit_fusion, flashinfer, transformers; print('torch', torch.__version__, 'flashinfer', flashinfer.__version__, 'transformers', transformers.__version__, 'GPUs', torch.cuda.device_count())" | tee -a "$LOG"
IFS=';' read -ra STAGES <<< "${PROFILE_JOBS:-0,1:280:w2:--world 2}"
for stage in "${STAGES[@]}"; do
  IFS='|' read -ra JOBS <<< "$stage"
  for job in "${JOBS[@]}"; do
    IFS=':' read -r gpus limit name args <<< "$job"
    if [[ $name == suite* ]]; then
      IFS=',' read -ra ids <<< "$gpus"
      ( LOG="$OUT/$name.log" CUDA_VISIBLE_DEVICES=$gpus GPU_WORLD_SIZE=${#ids[@]} GPU_FAULT_WORLDS=${#ids[@]} \
          step "$limit" bash -c "python3 -m pytest -q -p no:cacheprovider tests/gpu $args" ) &
    else
      ( LOG="$OUT/$name.log" CUDA_VISIBLE_DEVICES=$gpus step "$limit" python3 benchmarks/hf_tp_profile.py \
          --out "$OUT/profile_$name" --trace-dir "/tmp/traces/$name" $args ) &
    fi
  done
  wait
done
for f in "$OUT"/*.log; do [ "$f" = "$LOG" ] || { echo "=== $f"; tail -n 5 "$f"; } done
[ -d /tmp/traces ] && tar czf "$OUT/traces.tgz" -C /tmp traces
# at most 8 files come back: the tables stay, the JSON and the logs travel in one tarball
(cd "$OUT" && tar czf results.tgz profile_*.json *.log && rm -f profile_*.json *.log)
ls -la "$OUT"
