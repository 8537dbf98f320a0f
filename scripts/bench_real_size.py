"""The Qwen2.5-0.5B-shaped job, invariant and plain (`--lora RANK`: and the LoRA policy beside them):
weight sync, train/generate time, memory.

See rl_engine/benchmarks/real_size.py; `--help` lists the options.
"""

import sys

from rl_engine.benchmarks.real_size import main

if __name__ == "__main__":
    sys.exit(main())
