"""Decode throughput: invariant engine vs. plain engine vs. HF generate. See rl_engine/benchmarks/rollout.py."""

from rl_engine.benchmarks.rollout import main

if __name__ == "__main__":
    main()
