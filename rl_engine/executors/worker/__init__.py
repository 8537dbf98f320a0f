"""The DeepSpeed training worker: the plugin a host framework drives (no Ray, no job).

`policy.worker.DeepSpeedTrainingWorker` runs one data-parallel rank of the policy and
`critic.worker.CriticWorker` one of PPO's value model; `batch.TrainBatch` is what they train on.
One package per idea: `step` (the step loop both workers share, the `Update` protocol and the
plain update, the all-or-none guard, the recovery from an exception mid-step), `policy` (the
policy's setup, logprob module, loss, corrections, parity, router terms), `critic` (the value
model and its loss), `optim` (the optimizers), `layout_free` (`trainer.layout_invariant`: the
layout-free update, its loss, gradients and state), `weights` (export, checkpoints, the weights
file, the weight sync); beside them `batch_checks` and `micro_batches` (per-rank checks agreed
across ranks, micro-batches), `ds_config`, `distributed`, `errors`.
"""
