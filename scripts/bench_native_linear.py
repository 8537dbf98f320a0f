"""The native `linear` / `lm_head` ops vs F.linear: `rl-engine bench kernels --case native-linear`.

    python scripts/bench_native_linear.py [--before FILE] [--repeats 5] [--threads 2] [--dtypes fp32 bf16]

See rl_engine/benchmarks/native_linear.py; `--help` lists the options.
"""

from rl_engine.benchmarks.native_linear import main

if __name__ == "__main__":
    main()
