"""Kernel benchmark: invariant op / plain torch op, same run. Same as `rl-engine bench kernels`."""

import argparse

from rl_engine.benchmarks.kernels import main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fp32 only, fewer repetitions")
    main(quick=parser.parse_args().quick)
