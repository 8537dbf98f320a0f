"""CLI error handling, tasks and rewards, atomic writes."""

import os

import pytest

from rl_engine.cli import main
from rl_engine.io import write_json_atomic, write_text_atomic
from rl_engine.tasks import CountTask, make_task


def test_cli_rejects_unknown_config_keys_naming_them(tmp_path, caplog):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: tiny-llama\nrollout:\n  max_batch: 4\n")
    assert main(["train", "--config", str(bad)]) == 2
    assert "max_batch" in caplog.text


def test_cli_missing_config_file(tmp_path, caplog):
    assert main(["diagnose", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in caplog.text


def test_count_task_rewards_the_band_and_is_deterministic():
    task = CountTask(vocab_size=1000)
    assert task.prompts(3, step=5) == task.prompts(3, step=5) != task.prompts(3, step=6)
    assert task.rewards([0, 0], [[1, 2, 500, 999], [124, 125]], step=0) == [0.5, 0.5]
    with pytest.raises(ValueError, match="available tasks: count, arithmetic"):
        make_task("nope", vocab_size=10)
    with pytest.raises(ValueError, match="needs a model with a tokenizer"):
        make_task("arithmetic", vocab_size=10)


@pytest.mark.slow
def test_arithmetic_task_with_the_real_smollm2_tokenizer():
    from rl_engine.models import load_model

    _, tokenizer = load_model("smollm2-135m-instruct")
    task = make_task("arithmetic", vocab_size=49152, tokenizer=tokenizer, seed=0)
    prompts = task.prompts(2, step=0)
    a, b = task._operands(2, 0)[1]
    answer = tokenizer.encode(f"The answer is {a + b}.", add_special_tokens=False)
    wrong = tokenizer.encode(f"The answer is {a + b + 1}.", add_special_tokens=False)
    assert len(prompts) == 2 and all(isinstance(t, int) for t in prompts[0])
    assert task.rewards([1, 1], [answer, wrong], step=0) == [1.0, 0.0]


def test_atomic_writes_replace_whole_files_and_leave_no_temporaries(tmp_path):
    path = write_json_atomic(tmp_path / "r" / "report.json", {"a": 1})
    write_text_atomic(path, "second\n")
    assert path.read_text() == "second\n"
    assert sorted(os.listdir(path.parent)) == ["report.json"]
