"""`rl-engine diagnose --rollouts FILE --model SPEC --adapter DIR` and the config key `adapter:`.

Chain: a LoRA policy (tiny-llama, PEFT adapter with A and B perturbed: B != 0) is exported as
a PEFT adapter folder (what `rl-engine export RUN --to DIR` writes) and served by the
invariant RolloutEngine, unmerged; its rollout file, diagnosed on the base model with that
folder, recomputes every token bit for bit (exact 1.0, exit 0). Negative control: the same
file diagnosed on the base alone is not exact (exit 1): the adapter is what makes it match.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from rl_engine.cli import main
from rl_engine.config import RunConfig
from rl_engine.diagnostics.report import run_diagnosis
from rl_engine.executors.job.export_lora import write_lora_export
from rl_engine.executors.job.preflight import validate_before_start
from rl_engine.executors.worker.policy.setup import load_policy
from rl_engine.models import load_model
from rl_engine.patching import apply_batch_invariant
from rl_engine.patching.lora import is_adapter_name
from rl_engine.patching.lora_adapter import load_adapter
from rl_engine.rollout import RolloutEngine, SamplingParams, write_rollouts
from tests.helpers.lora_policy import perturb_adapters

MODEL = "tiny-llama"  # seed 0: the base `diagnose --model tiny-llama` loads
RUN = {"model": MODEL, "dtype": "float32", "seed": 0, "lora": {"rank": 4, "alpha": 8}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(adapter folder, the policy's adapter tensors, rollout file of the engine serving it)."""
    root = tmp_path_factory.mktemp("lora_rollouts")
    config = RunConfig.from_dict(RUN)
    policy, _ = load_policy(config)
    perturb_adapters(policy)
    write_lora_export(config, policy.state_dict(), root / "adapter", merged=False)
    adapters = {k: v.clone() for k, v in policy.state_dict().items() if is_adapter_name(k)}
    apply_batch_invariant(policy)
    engine = RolloutEngine(policy, device="cpu", max_batch_size=3, progress=False)
    prompts = [[5 + 7 * i + j for j in range(6)] for i in range(3)]
    completions = engine.generate(
        prompts, SamplingParams(max_new_tokens=10, temperature=0.8, n=2, seed=1)
    )
    return root / "adapter", adapters, write_rollouts(root / "lora.jsonl", completions)


def _diagnose(path, out, *extra) -> tuple[int, dict]:
    argv = ["diagnose", "--rollouts", str(path), "--model", MODEL, "--output-dir", str(out)]
    code = main([*argv, *extra])
    report = out / "report.json"
    return code, json.loads(report.read_text()) if report.exists() else {}


def _exact(data: dict) -> float:
    return data["modes"]["batch_invariant=true"]["metrics"]["exact_match_fraction"]


def test_rollouts_of_a_lora_policy_diagnose_exact_with_its_adapter_only(served, tmp_path):
    adapter, _, rollouts = served
    code, data = _diagnose(rollouts, tmp_path / "with", "--adapter", str(adapter))
    assert code == 0 and _exact(data) == 1.0
    assert data["adapter"] == str(adapter)
    assert f"{MODEL} + adapter {adapter}" in (tmp_path / "with" / "report.md").read_text()
    code, data = _diagnose(rollouts, tmp_path / "without")  # negative control: the base alone
    assert code == 1 and _exact(data) < 1.0
    assert data["adapter"] is None


def test_the_loaded_adapter_is_the_exported_one_frozen(served):
    adapter, adapters, _ = served
    model, _ = load_model(MODEL, dtype=torch.float32)
    load_adapter(model, adapter)
    state = model.state_dict()
    assert {k for k in state if is_adapter_name(k)} == adapters.keys()
    for name, tensor in adapters.items():
        assert torch.equal(state[name], tensor), name
    assert not any(p.requires_grad for p in model.parameters())


def test_an_adapter_of_another_base_is_an_error_naming_the_file(served, tmp_path, caplog):
    adapter, _, rollouts = served
    other, _ = load_model("tiny-qwen3", dtype=torch.float32)
    weights = adapter / "adapter_model.safetensors"
    with pytest.raises(ValueError, match=rf"{weights}: .*q_proj.lora_A.weight is \(4, 96\) but"):
        load_adapter(other, adapter)
    argv = ["--adapter", str(adapter), "--model", "tiny-qwen3"]
    code = main(["diagnose", "--rollouts", str(rollouts), "--output-dir", str(tmp_path), *argv])
    assert code == 2 and "an adapter of another base model" in caplog.text
    assert not (tmp_path / "report.json").exists()


def test_an_adapter_that_is_not_plain_lora_or_missing_is_refused(served, tmp_path):
    adapter, _, _ = served
    dora = shutil.copytree(adapter, tmp_path / "dora")
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    model, _ = load_model(MODEL, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"dora/adapter_config.json: \{'use_dora': True\}"):
        load_adapter(model, dora)
    with pytest.raises(FileNotFoundError, match="nowhere/adapter_config.json not found"):
        load_adapter(model, tmp_path / "nowhere")


def test_the_config_key_adapter_diagnoses_the_lora_policy_and_training_refuses_it(served, tmp_path):
    adapter, _, _ = served
    data = {
        **RUN,
        "adapter": str(adapter),
        "output_dir": str(tmp_path),
        "rollout": {"prompts_per_step": 2, "samples_per_prompt": 2, "max_new_tokens": 6},
        "trainer": {"micro_batch_size": 4},
    }
    report = run_diagnosis(RunConfig.from_dict(data))
    invariant = report.results[0]
    assert invariant.batch_invariant and invariant.metrics.exact_match_fraction == 1.0
    saved = json.loads((tmp_path / "diagnosis" / "report.json").read_text())
    assert saved["adapter"] == str(adapter)
    with pytest.raises(ValueError, match="adapter: .* is read by `rl-engine diagnose --config`"):
        validate_before_start(RunConfig.from_dict(data))
    with pytest.raises(ValueError, match="lora.rank is 8"):  # the run's shape, checked
        run_diagnosis(RunConfig.from_dict({**data, "lora": {"rank": 8, "alpha": 16}}))
