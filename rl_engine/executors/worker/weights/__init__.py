"""Weights out of the worker: export, the weights file, checkpoints, the weight sync to engines."""
