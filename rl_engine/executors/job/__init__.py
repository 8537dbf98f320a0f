"""The Ray job around the worker: `ray_job.run_job` and the modules of its concerns.

`actors` (engine and trainer-rank actors, weight sync), `cluster` (join or start Ray,
placement, kernel facts), `preflight` (config checks before Ray starts), `run_dir`,
`job_checkpoints`, `faults`, `job_reports`, `progress`, `rollout_source`, `export`.
Depends on `executors.worker`, never the reverse.
"""
