"""Every exact sum of the package, one function (or type) per kind of sum.

- `float_sums`: `exact_sum` of Python floats (correctly rounded, inf and NaN as float adds) and
  per-row sums of a tensor whose bits only the row defines;
- `canonical_sum`: the canonical tree over a step's sequence order, for tensors (`CanonicalSum`,
  `combine`), the same adds for every split of the sequences over micro-batches and ranks;
- `row_partial`: a partial that touches some rows only, added as its dense form would be;
- `sequence_gradients`: the sink a layout-free backward writes its per-sequence partials to;
- `records`: named float sums that cross a collective as one tensor (`Sums`) and per-sequence
  records totalled exactly (`SequenceRecords`).

The LM head's deferred partial (`ProductPartial`) is the form a kernel's backward hands out,
so it lives with the kernels (`rl_engine/kernels/common/product_partial.py`); the tree here
evaluates it.
"""
