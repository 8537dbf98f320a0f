"""A step of 4 mini-batches, parity_scope first vs all: `rl-engine bench train --case mini-batches`.

    DS_ACCELERATOR=cpu .venv/bin/python scripts/bench_mini_batches.py [--steps N] [--model M]

See rl_engine/benchmarks/mini_batches.py; `--help` lists the options.
"""

from rl_engine.benchmarks.mini_batches import main

if __name__ == "__main__":
    main()
