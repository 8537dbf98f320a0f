"""The DeepSpeed worker on one GPU (run by scripts/gpu_check.sh when deepspeed is installed).

Chain: a RolloutEngine on cuda (Triton kernels) samples completions; a
DeepSpeedTrainingWorker(config with device: cuda) on cuda:LOCAL_RANK (nccl,
DeepSpeed's CUDA accelerator, Triton kernels) scores them before its update:
every token's logprob equals the engine's, bitwise (parity: strict).
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_worker_on_cuda_has_bitwise_parity_with_the_cuda_engine():
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    from rl_engine.executors.worker.policy.worker import DeepSpeedTrainingWorker
    from rl_engine.models import load_model
    from rl_engine.patching import apply_batch_invariant, patch_handle
    from rl_engine.rollout import RolloutEngine
    from tests.helpers.worker.cell import cell_config, generate, to_batch

    config = cell_config(0, 1, "bfloat16", device="cuda")
    model, _ = load_model(config.model, dtype=config.torch_dtype, seed=config.seed)
    model.to("cuda")  # move, then patch: the ops are resolved for cuda (triton)
    apply_batch_invariant(model)
    engine = RolloutEngine(model, device="cuda", max_batch_size=8, progress=False)
    completions = generate(engine, config, seed=5)

    worker = DeepSpeedTrainingWorker(config, device=config.device)  # bare cuda: cuda:LOCAL_RANK
    assert worker.device == torch.device("cuda", 0)
    assert patch_handle(worker.module.policy).backend == "triton"
    metrics = worker.train_step(to_batch(completions))
    assert metrics["parity/exact_match_fraction"] == 1.0
    assert metrics["parity/max_abs_diff"] == 0.0
