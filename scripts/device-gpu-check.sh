#!/usr/bin/env bash
# `dflash-agent bench --gpu-check` on this workplace's lent GPU machine (the `device` tool's H200). Its image holds
# torch, triton, transformers, pytest and pytest-xdist but not every package the GPU path imports, and it reaches no
# network, so the missing ones travel as wheels:
#   here, once:  scripts/device-gpu-check.sh prepare      # cp312 wheels into .whl/ (git-excluded), at .venv's versions
#   there:       run(command="bash scripts/device-gpu-check.sh run 540", carry=[".whl"], timeout_s=580)
#   or there:    run(command="bash scripts/device-gpu-check.sh probe 480", carry=[".whl"], timeout_s=500): the kernel
#                tests, then scripts/gpu_probe.py (where a step's time goes; the quant GEMV's launch shapes)
# `run` leaves the log and the JSON (written after each step) under $OUT, so a run stopped at its limit keeps what it
# measured. The embedded Gemma 3 270M does not travel (250 MB): the tests that need it skip there.
set -euo pipefail
cd "$(dirname "$0")/.."
# what the GPU path imports and the image lacks (the device image lists what it holds)
WHEELS=(gguf msgspec xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection)

case "${1:-}" in
prepare)
    pins=()
    for name in "${WHEELS[@]}"; do
        pins+=("$name==$(.venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")")
    done
    rm -rf .whl
    platforms=()
    for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
        platforms+=(--platform "$p")
    done
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d .whl "${pins[@]}"
    exclude="$(git rev-parse --git-path info/exclude)"
    mkdir -p "$(dirname "$exclude")"
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
    du -sh .whl
    ;;
run | probe)
    # seconds the check may take, under the device call's timeout_s, so the results are copied before it ends
    limit="${2:-540}"
    : "${OUT:?run it on the device machine, where OUT is set}"
    compgen -G '.whl/*.whl' >/dev/null || { echo "no wheels in .whl/: prepare here, and carry .whl" >&2; exit 2; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt" || true
    if [ "$1" = probe ]; then
        timeout -k 5 $((limit / 3)) python3 -m pytest -q -p no:cacheprovider --tb=short -n 12 \
            tests/kernels/test_quant_matmul.py tests/kernels/test_quant_tuning.py tests/kernels/test_packed_model.py >"$OUT/probe-tests.log" 2>&1 || true
        tail -n 15 "$OUT/probe-tests.log"
        left=$((limit - SECONDS))
        timeout -k 5 $((left - 5)) python3 scripts/gpu_probe.py "$OUT" $((left - 40)) 2>&1 | tee "$OUT/probe.log"
        exit 0
    fi
    status=0
    timeout -k 10 "$limit" python3 -m dflash_agent bench --gpu-check --out "$OUT/gpu-check.json" 2>&1 \
        | tee "$OUT/gpu-check.log" || status=$?
    cp bench-results/synthetic-*.json "$OUT/" 2>/dev/null || true
    # the tiles timed on this GPU (kernels.triton.quant_tuning): each shape's fastest beside the default
    cp "${DFLASH_AGENT_CACHE:-$HOME/.cache/dflash-agent}/kernel-tuning.json" "$OUT/" 2>/dev/null || true
    exit "$status"
    ;;
*)
    echo "usage: scripts/device-gpu-check.sh prepare | run [SECONDS] | probe [SECONDS]" >&2
    exit 2
    ;;
esac
