"""The policy worker (`worker.DeepSpeedTrainingWorker`) and what only it needs."""
