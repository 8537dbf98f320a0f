"""The Ray job around the worker: `ray_job.run_job` and the modules of its concerns.

The step's stages, one module each: `prompts`, `rollouts` (with `scorers`), `step_batch`,
`training` (with `ppo_step`), `weight_sync`, `step_metrics` (with `trackers`); the actors
(`actors/`: their classes, placement, kernel check and start); around the loop `cluster`,
`preflight`, `run_dir`, `job_checkpoints`, `faults`, `evaluation`, `reward_workers`,
`job_reports`, `progress`, `export`. Depends on `executors.worker`, never the reverse.
"""
