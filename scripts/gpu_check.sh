#!/usr/bin/env bash
# GPU check of the Triton backend: one prepared command, under 5 minutes on one H100/H200.
#
#   scripts/gpu_check.sh          (results in $OUT, or ./gpu_check_out)
#
# On real CUDA (compiled kernels, never the interpreter) it runs:
#   1. the gpu-marked tests (tests/gpu: kernel invariance at realistic sizes, decode ==
#      prefill, fused == unfused, rollout engine == token_logprobs recompute on random
#      Llama / Qwen3 models in bf16), and the triton-marked registry, attention-layout and
#      tiny-model chain tests on cuda (the row-wise op tests are the interpreter's);
#   2. the DeepSpeed worker on one rank if deepspeed imports (carried as a wheel), else
#      it is reported as skipped;
#   3. the kernel benchmark: Triton vs cuBLAS / SDPA / materialised logits, same run;
# then prints one summary table. Needs torch, triton, transformers, pytest; pure-Python
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
timeout 170 $PY -m pytest -q -p no:cacheprovider -m "gpu or triton" -rs \
    tests/gpu tests/kernels/test_registry.py tests/kernels/test_triton_attention.py \
    tests/rollout/test_triton_chain.py \
    --junitxml="$OUT/tests.xml" 2>&1 | tee "$OUT/tests.log"

echo "== deepspeed worker (one rank)"
if $PY -c "import deepspeed" 2>/dev/null; then
    DS_ACCELERATOR=cuda timeout 45 $PY -m pytest -q -p no:cacheprovider -m gpu -rs \
        tests/executors/test_worker_gpu.py --junitxml="$OUT/deepspeed.xml" 2>&1 | tee "$OUT/deepspeed.log"
else
    echo "skipped: deepspeed is not installed (carry a wheel in .whl/ to run it)" | tee "$OUT/deepspeed.log"
fi

echo "== kernel benchmark"
timeout 75 $PY -m rl_engine.benchmarks.gpu_kernels --out "$OUT/bench.md" 2>&1 | tee "$OUT/bench.log"

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
for name in ("tests.xml", "deepspeed.xml"):
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
bench = out / "bench.md"
print()
print(bench.read_text() if bench.exists() else "benchmark: did not finish (see bench.log)")
PYEOF
