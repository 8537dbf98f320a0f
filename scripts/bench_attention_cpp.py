"""The cpp attention op vs SDPA at 1 and 2 threads: `rl-engine bench kernels --case attention`.

    python scripts/bench_attention_cpp.py [--reps 7] [--threads 2 1] [--dtypes float32 bfloat16] [--only SUBSTRING]

See rl_engine/benchmarks/attention_cpp.py; `--help` lists the options.
"""

from rl_engine.benchmarks.attention_cpp import main

if __name__ == "__main__":
    main()
