"""Logprob-mismatch diagnostics: rollout engine vs. trainer recompute, invariance on and off.

    python scripts/logprob_mismatch.py --config configs/diagnose_tiny.yaml

Same as `rl-engine diagnose --config ...`. Prints a markdown table and writes
report.json, report.md and mismatch.png to <output_dir>/diagnosis.
"""

import sys

from rl_engine.cli import main

if __name__ == "__main__":
    sys.exit(main(["diagnose", *sys.argv[1:]]))
