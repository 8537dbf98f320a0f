"""The layout-free update (`trainer.layout_invariant: true`): per-sequence gradient partials
summed by a canonical tree, the loss weighted by exact counts, the training state per parameter."""
