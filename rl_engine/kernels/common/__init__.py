"""Backend-independent pieces of the kernels: every op written once around a backend's kernels.

Each `common/<op>.py` holds the op's one signature, its argument checks, the
plain-torch backward and the autograd.Function scaffolding, and a builder
(`linear_op`, `attention_op`, ...) that a backend calls with its kernels (its
forward, its backward where it has its own) and its `op.Serving` (device check,
the dtypes it keeps invariant). `op.py` turns that into the strict op and its
`allow_non_invariant` twin. The numerics of an op are therefore those of the
backend's kernels; the code around them is shared. Nothing here imports a backend.
"""
