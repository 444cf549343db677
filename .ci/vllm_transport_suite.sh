#!/usr/bin/env bash
# vLLM 0.33.0's own data-transport tests against our NixlTransport (tests/vllm_compat/vllm_shim.py).
# The vllm-0.33.0 sdist comes from the package index through pip's own index machinery (so pip's
# configuration applies: index URL, proxy, certificates) and is cached, hash-checked, in .cache/.
# `pip download --no-binary` cannot be used: it builds vLLM's metadata. No vLLM code is committed.
# `--fetch-only`: fetch and unpack the test, run nothing (.ci/run fetches it beside lint).
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.33.0
TEST=tests/v1/kv_offload/tiering/p2p/test_data_transport.py
CACHE=.cache/vllm-sdist
mkdir -p "$CACHE"

python - "$VERSION" "$CACHE" "$TEST" <<'PY'
import hashlib
import sys
import tarfile
from pathlib import Path

from pip._internal.commands import create_command

version, cache, test = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
sdist = cache / f"vllm-{version}.tar.gz"
if not sdist.exists():
    command = create_command("download")
    options, _ = command.parse_args([])
    with command._build_session(options) as session:
        finder = command._build_package_finder(options, session)
        links = [
            c.link
            for c in finder.find_all_candidates("vllm")
            if str(c.version) == version and c.link.filename.endswith(".tar.gz")
        ]
        if not links:
            sys.exit(f"no vllm-{version} sdist on the package index")
        link = links[0]
        response = session.get(link.url.split("#")[0])
        response.raise_for_status()
        data = response.content
    expected = link.hash if link.hash_name == "sha256" else None
    if expected and hashlib.sha256(data).hexdigest() != expected:
        sys.exit(f"{link.filename}: sha256 mismatch, not using it")
    partial = sdist.with_suffix(".part")
    partial.write_bytes(data)
    partial.rename(sdist)
with tarfile.open(sdist) as tar:
    member = tar.getmember(f"vllm-{version}/{test}")
    (cache / Path(test).name).write_bytes(tar.extractfile(member).read())
PY
if [ "${1:-}" = --fetch-only ]; then exit 0; fi

PYTHONPATH="$PWD:$PWD/tests/vllm_compat${PYTHONPATH:+:$PYTHONPATH}" \
  python -m pytest -q -rs -p vllm_shim -p no:cacheprovider "$CACHE/$(basename "$TEST")"
