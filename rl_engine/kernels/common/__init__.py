"""Backend-independent pieces of the kernels: argument checks, the plain-torch
backward passes and algorithms, and the autograd.Function scaffolding.

Every backend (native, triton, ...) imports from here; nothing here imports a
backend. A backend passes its own kernels in (its forward, its `lm_head` /
`log_softmax` chunk) and keeps its tile constants; the numerics of an op are
therefore those of the backend's kernels, the code around them is shared.
"""
