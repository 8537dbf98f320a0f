"""The fixed-order cpp GEMM vs F.linear: `rl-engine bench kernels --case gemm`, with its options.

    python scripts/bench_gemm.py [--repeats 7] [--threads 1 2] [--dtypes fp32 bf16] [--shapes SUBSTRING ...]

See rl_engine/benchmarks/gemm.py; `--help` lists the options.
"""

from rl_engine.benchmarks.gemm import main

if __name__ == "__main__":
    main()
