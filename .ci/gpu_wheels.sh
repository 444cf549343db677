#!/usr/bin/env bash
# Fill .whl/ with what .ci/gpu_check.sh installs on a CUDA machine that has torch but no package
# registry (Python 3.12, x86-64, CUDA 13): the project's dependencies other than torch, numpy and
# xxhash, at the versions installed here (PYTHON, default .venv/bin/python), as cp312 wheels.
# nixl-cu13's wheel (~59 MB) is unpacked and only its NIXL modules and libraries are kept, in
# one tarball (~16 MB): its nixl_ep_cu13 extension and C++ headers are not used.
# .whl/ is kept out of git (.git/info/exclude). Needs network access to the package index.
set -euo pipefail
py=${PYTHON:-.venv/bin/python}
version() { "$py" -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }
nixl=$(version nixl)
pins=("nixl==${nixl:?nixl is not installed in $py}" "nixl-cu13==$nixl"
    "pyzmq==$(version pyzmq)" "msgspec==$(version msgspec)" "dnspython==$(version dnspython)")
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
rm -rf .whl && mkdir .whl
platforms=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${p}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl "${pins[@]}"
unpacked=$(mktemp -d)
unzip -q .whl/nixl_cu13-*.whl -d "$unpacked"
tar -C "$unpacked" -cJf .whl/nixl_cu13.tar.xz nixl_cu13 nixl_cu13.libs \
    .nixl_cu13.mesonpy.libs "nixl_cu13-$nixl.dist-info"
rm -rf "$unpacked" .whl/nixl_cu13-*.whl
du -sh .whl
ls .whl
