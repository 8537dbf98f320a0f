#!/usr/bin/env bash
# GPU check of the Triton backend: one prepared command, under 5 minutes on one H100/H200.
#
#   scripts/gpu_check.sh          (results in $OUT, or ./gpu_check_out)
#
# On real CUDA (compiled kernels, never the interpreter) it runs:
#   1. the gpu-marked tests (tests/gpu: kernel invariance at realistic sizes, decode ==
#      prefill, fused == unfused, rollout engine == token_logprobs recompute on random
#      Llama / Qwen3 models in bf16, rounding accuracy against fp64), and the triton-marked
#      registry, attention-layout, tiny-model chain and layout-invariant backward tests on
#      cuda (the row-wise op tests
#      are the interpreter's);
#   2. the real-size parity case: a Qwen2.5-0.5B-shaped random Qwen2 (vocab 151936, 24
#      layers) in bf16, rollout engine == recompute;
#   3. the compiled kernels: scripts/compile_gpu_kernels.py ahead of time for this
#      device's architecture (stub driver, checks a-d, shared memory), then the same launch
#      cases run on the GPU for real, in a fresh Triton cache, and the hash and cubin of
#      every binary the JIT launched must equal the ahead-of-time one;
#   4. the DeepSpeed worker on one rank if deepspeed imports (carried as a wheel), else
#      it is reported as skipped;
#   5. the kernel benchmark: Triton vs cuBLAS / SDPA / materialised logits, same run;
# then prints one summary table. Timeouts sum to under 5 minutes (not yet run on hardware). Needs torch, triton, transformers, pytest; pure-Python
# packages that are missing can be carried as wheels in .whl/ (installed without an index).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
PY="${PY:-python3}"
unset TRITON_INTERPRET
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

$PY -c 'import torch, triton, transformers; print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | transformers {transformers.__version__}")' \
    | tee "$OUT/env.txt" || { echo "no usable CUDA device / packages"; exit 1; }

echo "== tests (gpu + triton on cuda)"
timeout 110 $PY -m pytest -q -p no:cacheprovider -m "gpu or triton" -rs -k "not qwen2_0p5b" \
    tests/gpu tests/kernels/test_registry.py tests/kernels/test_triton_attention.py \
    tests/rollout/test_triton_chain.py tests/kernels/test_triton_sequence_backward.py \
    --junitxml="$OUT/tests.xml" 2>&1 | tee "$OUT/tests.log"

echo "== real size: Qwen2.5-0.5B-shaped bf16, engine == recompute"
timeout 50 $PY -m pytest -q -p no:cacheprovider -m gpu -rs -k qwen2_0p5b tests/gpu \
    --junitxml="$OUT/realsize.xml" 2>&1 | tee "$OUT/realsize.log"

echo "== compiled kernels: ahead of time vs launched"
ARCH=$($PY -c 'import torch; print("sm_%d%d" % torch.cuda.get_device_capability())')
TRITON_CACHE_DIR="$OUT/triton_cache_aot" timeout 40 $PY scripts/compile_gpu_kernels.py \
    --targets "$ARCH" --cases ci --out "$OUT/kernels_aot" 2>&1 | tee "$OUT/kernels_aot.log"
TRITON_CACHE_DIR="$OUT/triton_cache_launched" timeout 25 $PY scripts/compile_gpu_kernels.py \
    --launch --cases ci --compare "$OUT/kernels_aot/manifest.json" --out "$OUT/kernels_launched" \
    2>&1 | tee "$OUT/kernels_launched.log"

echo "== deepspeed worker (one rank)"
if $PY -c "import deepspeed" 2>/dev/null; then
    DS_ACCELERATOR=cuda timeout 30 $PY -m pytest -q -p no:cacheprovider -m gpu -rs \
        tests/parity/test_worker_gpu.py --junitxml="$OUT/deepspeed.xml" 2>&1 | tee "$OUT/deepspeed.log"
else
    echo "skipped: deepspeed is not installed (carry a wheel in .whl/ to run it)" | tee "$OUT/deepspeed.log"
fi

echo "== kernel benchmark"
timeout 40 $PY -m rl_engine.benchmarks.gpu_kernels --out "$OUT/bench.md" 2>&1 | tee "$OUT/bench.log"

echo
echo "== summary"
$PY - "$OUT" <<'PYEOF'
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

out = Path(sys.argv[1])
print("| suite | passed | failed | skipped |")
print("|---|---:|---:|---:|")
for name in ("tests.xml", "realsize.xml", "deepspeed.xml"):
    path = out / name
    if not path.exists():
        what = "deepspeed worker: not installed" if name == "deepspeed.xml" else "tests: did not run"
        print(f"| {what} | - | - | skipped |")
        continue
    per_file = {}
    for case in ET.parse(path).iter("testcase"):
        key = case.get("classname", "?")
        state = "failed" if case.find("failure") is not None or case.find("error") is not None else (
            "skipped" if case.find("skipped") is not None else "passed")
        per_file.setdefault(key, Counter())[state] += 1
    for key, c in sorted(per_file.items()):
        print(f"| {key} | {c['passed']} | {c['failed']} | {c['skipped']} |")
for name in ("kernels_aot.log", "kernels_launched.log"):
    log = out / name
    lines = log.read_text().strip().splitlines() if log.exists() else []
    verdict = lines[-1] if lines else "did not run"
    print(f"| {name.removesuffix('.log').replace('_', ' ')}: {verdict} | - | - | - |")
bench = out / "bench.md"
print()
print(bench.read_text() if bench.exists() else "benchmark: did not finish (see bench.log)")
PYEOF
