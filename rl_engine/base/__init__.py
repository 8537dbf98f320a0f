"""The floor every layer above `kernels/` may stand on: standard library and torch only.

- `io`: atomic file writes (a report or checkpoint is complete or absent);
- `fields`: one wording for every error a typed config field raises;
- `memory_pages`: a live tensor's pages handed back to the OS between its uses;
- `slab_arena`: long-lived small tensors packed into slabs, off the fragmenting heap;
- `moved_modules`: the old import paths of modules that moved, for one release.
"""
