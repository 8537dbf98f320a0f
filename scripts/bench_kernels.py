"""Kernel benchmark: invariant op / plain torch op, same run. Same as `rl-engine bench kernels [--quick]`."""

from rl_engine.benchmarks.kernels import main

if __name__ == "__main__":
    main()
