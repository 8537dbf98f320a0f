"""The DeepSpeed training worker: the plugin a host framework drives (no Ray, no job).

`deepspeed_trainer.DeepSpeedTrainingWorker` runs one data-parallel rank; `batch.TrainBatch`
is what it trains on. Around the step, one module per concern: `batch_checks` (per-rank
checks agreed across ranks, micro-batches), `step_loss` and `step_corrections` (the loss,
its metrics, rollout corrections and the scoring pass), `parity_check` (the parity check),
`recovery` (an exception mid-step), `policy` (load, patch, the logprob module, StepGuard),
`checkpoints` (weights export, DeepSpeed checkpoints), `ds_config`, `distributed`, `errors`.
PPO's value model: `critic.CriticWorker` (its own ranks) on `value_model.ValueModule`.
"""
