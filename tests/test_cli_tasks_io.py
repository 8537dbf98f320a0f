"""CLI error handling, tasks and rewards, atomic writes."""

import os
import stat

import pytest

from rl_engine.cli import main
from rl_engine.base.io import write_json_atomic, write_text_atomic
from rl_engine.data.tasks import (
    CountTask,
    answer_matches,
    final_answer,
    make_task,
)


def reward_longer_is_better(samples):
    """A user reward (`rollout.task: tests.test_cli_tasks_io:reward_longer_is_better`)."""
    return [float(len(s["completion_ids"])) for s in samples]


def test_cli_rejects_unknown_config_keys_naming_them(tmp_path, caplog):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: tiny-llama\nrollout:\n  max_batch: 4\n")
    assert main(["train", "--config", str(bad)]) == 2
    assert "rollout.max_batch" in caplog.text


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


def test_final_answer_rule():
    assert final_answer("7 + 5 = 12") == "12" and final_answer("The answer is 12.") == "12"
    assert answer_matches("so it is -3", "-3") and not answer_matches("12, not 13", "12")
    assert answer_matches("It is Paris.", "Paris") and not answer_matches("Paris, I think", "Paris")
    assert not answer_matches("", "1") and not answer_matches("Sparis", "paris")


def test_user_reward_function_gets_samples_over_builtin_prompts():
    task = make_task(
        "tests.test_cli_tasks_io:reward_longer_is_better", vocab_size=1000, tokenizer=None
    )
    prompts = task.prompts(2, step=0)
    assert prompts == CountTask(vocab_size=1000).prompts(2, step=0)
    assert task.rewards([0, 1], [[5, 6, 7], [8]], step=0) == [3.0, 1.0]
    bad = make_task("tests.test_cli_tasks_io:final_answer", vocab_size=1000)
    with pytest.raises((ValueError, TypeError)):
        bad.rewards([0], [[5]], step=0)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
        ("tests.test_cli_tasks_io:missing", "has no function 'missing'"),
        ("jsonl:/nonexistent/prompts.jsonl", "does not exist"),
    ],
)
def test_task_spec_errors_name_the_problem(spec, message):
    with pytest.raises(ValueError, match=message):
        make_task(spec, vocab_size=10)


def test_a_task_function_loads_from_a_file_path_as_reward_function_does(tmp_path):
    """rollout.task and reward.function share one loader: `path.py:name` works for both."""
    reward = tmp_path / "my_reward.py"
    reward.write_text(
        "def shorter(samples):\n    return [-float(len(s['completion_ids'])) for s in samples]\n"
    )
    task = make_task(f"{reward}:shorter", vocab_size=1000)
    assert task.rewards([0, 1], [[5, 6, 7], [8]], step=0) == [-3.0, -1.0]
    with pytest.raises(ValueError, match=r"rollout\.task .*my_reward\.py has no function 'nope'"):
        make_task(f"{reward}:nope", vocab_size=1000)


def _word_tokenizer():
    """A real (word-level) Hugging Face fast tokenizer built in code."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "[UNK] [EOS] what is two plus three ? the answer 5 4 capital of france paris .".split()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]")


def test_jsonl_task_prompts_and_rewards(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        '{"prompt": "what is two plus three ?", "answer": "5"}\n\n'
        '{"prompt": "the capital of france ?", "answer": "paris"}\n'
    )
    tokenizer = _word_tokenizer()
    task = make_task(f"jsonl:{path}", vocab_size=20, tokenizer=tokenizer, seed=1)
    prompts = task.prompts(2, step=0)
    assert sorted(tokenizer.decode(p) for p in prompts) == [
        "the capital of france ?",
        "what is two plus three ?",
    ]
    answers = task.answers(2, step=0)
    right = [tokenizer.encode(f"the answer {a}") for a in answers]
    wrong = [tokenizer.encode("the answer 4") for _ in answers]
    assert task.rewards([0, 1, 0, 1], right + wrong, step=0) == [1.0, 1.0, 0.0, 0.0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "answer": "1"}\n{"prompt": "y"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: expected"):
        make_task(f"jsonl:{bad}", vocab_size=20, tokenizer=tokenizer)


@pytest.mark.slow
def test_arithmetic_task_with_the_real_smollm2_tokenizer(smollm2):
    _, tokenizer = smollm2
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
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
