"""PPO's critic: `worker.CriticWorker`, its value model and value loss."""
