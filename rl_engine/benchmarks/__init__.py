"""Benchmarks: invariant ops vs. the plain-torch path, measured in the same run."""
