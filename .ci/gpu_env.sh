# Sourced by the device scripts (gpu_check.sh, gpu_cpu_scaling.sh) with $out and $log set:
# installs .whl/ (from gpu_wheels.sh) into /tmp/site if present, puts the repository on
# PYTHONPATH, sets $py (PYTHON, default python3) and $failed, and defines `step`.
mkdir -p "$out"
py=${PYTHON:-python3}
if [ -d .whl ]; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
        .whl/*.whl || exit 1
    for t in .whl/*.tar.xz; do [ -e "$t" ] && tar xJf "$t" -C /tmp/site; done
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
failed=0

step() {  # step NAME TIMEOUT_S COMMAND...: output appended to $log, its tail echoed
    local name=$1 limit=$2 start=$SECONDS rc part
    shift 2
    part=$(mktemp)
    echo "=== $name: $*" | tee -a "$log"
    timeout "$limit" "$@" >"$part" 2>&1
    rc=$?
    cat "$part" >>"$log"
    tail -n 15 "$part"
    rm -f "$part"
    echo "=== $name: rc=$rc after $((SECONDS - start)) s" | tee -a "$log"
    [ "$rc" -eq 0 ] || failed=1
}
