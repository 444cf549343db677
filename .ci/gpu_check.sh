#!/usr/bin/env bash
# The CUDA checks that CI cannot run (CI has no GPU): every CUDA test, the CUDA torch-loop example
# in both staging modes, `bench --device cuda` with the copy ceiling and verification on/off, and
# `digest-cost --device cuda` (where a GPU arena's digests spend their time).
# Then, while a machine with many cores is at hand, `shared-bench` at 1 and 4 tiers: on the
# 2-core development VM four tier processes and a host saturate the CPU, so its shared/private
# store ratio is a ratio of CPU per byte; here it is the pool's own.
#
# Run from the repository root on a CUDA machine that has torch; the project's other
# dependencies either installed or in .whl/ (made by .ci/gpu_wheels.sh on a machine with the
# package index: wheels, and nixl-cu13 as a tarball of its unpacked modules), which are installed
# into /tmp/site first. The log (gpu-check.log) and results go to $OUT (default ./gpu-check),
# five files. Each step has its own timeout (tests, examples and bench took 3 minutes on an H200);
# the script exits 1 if any step failed. TESTS_K replaces the tests' -k selection (default: the
# CUDA tests, `cuda or vram`); PYTHON the interpreter (default python3).
set -uo pipefail
out=${OUT:-gpu-check}
log=$out/gpu-check.log
source "$(dirname "$0")/gpu_env.sh"

step env 60 bash -c "nvidia-smi -L; $py -c 'import torch, nixl._api; \
print(torch.__version__, torch.cuda.get_device_name(0))'"
step tests 150 $py -m pytest -q -rs -p no:cacheprovider -k "${TESTS_K:-cuda or vram}" \
    tests/test_arena.py tests/test_digest.py tests/test_torch_loop.py tests/test_transport*.py \
    tests/test_bench*.py tests/test_digest_cost.py
for staging in device host; do
    step example 60 $py -m torch_kv_tier.integrations.torch_loop.example --device cuda \
        --staging "$staging"
done
step digest 90 $py -m torch_kv_tier digest-cost --device cuda --arena-mib 1024 --rounds 5 \
    --json "$out/digest-cuda.json"
step bench 240 $py -m torch_kv_tier --log-level WARNING bench --device cuda --no-progress \
    --transports shm --block-sizes 16K,64K,256K,2M --repeats 3 --no-poll-scaling \
    --systems memcpy,nixl_raw,torch_kv_tier,torch_kv_tier_noverify,torch_kv_tier_staged \
    --out "$out/bench-cuda.json" --plot "$out/bench-cuda.png"
step shared 240 $py -m torch_kv_tier --log-level ERROR shared-bench --block-sizes 64K,256K \
    --tiers 1,4 --hosts 1 --rounds 5 --json "$out/shared-bench.json"
exit "$failed"
