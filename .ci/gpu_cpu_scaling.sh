#!/usr/bin/env bash
# shared-bench's shared/private ratios against the CPUs the run may use: the same commands on
# the same many-core machine (the GPU machine: 16 cores), confined with taskset to CPUS (default
# "2 4 8") CPUs each. On the 2-core development VM several tiers' stores stay under 0.9 while
# 16 cores meet it (gpu_check.sh's shared step); this tells a CPU-per-byte gap from a pool
# that is slow at any core count. Needs no GPU. Results: $OUT (default ./gpu-cpu-scaling),
# shared-<n>cpu.json per count and one log; each count under its own timeout (STEP_S, 200 s).
set -uo pipefail
out=${OUT:-gpu-cpu-scaling}
log=$out/cpu-scaling.log
source "$(dirname "$0")/gpu_env.sh"
for n in ${CPUS:-2 4 8}; do
    step "shared-${n}cpu" "${STEP_S:-200}" taskset -c "0-$((n - 1))" $py -m torch_kv_tier \
        --log-level ERROR shared-bench --block-sizes 64K,256K --tiers 1,4 --hosts 1 --rounds 5 \
        --json "$out/shared-${n}cpu.json"
done
exit "$failed"
