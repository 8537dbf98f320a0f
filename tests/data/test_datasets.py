"""Prompt datasets: verl-layout parquet written with HF datasets, JSON lines with renamed
columns, chat templates, max_prompt_length, and the seeded per-epoch prompt stream."""

from __future__ import annotations

import json

import pytest

from rl_engine.config import DataConfig, RunConfig
from rl_engine.data import DataFileError, PromptStream, check_dataset, load_dataset
from tests.helpers.chat_model import build_tokenizer


def verl_rows(count: int, source: str = "toy/add") -> list[dict]:
    """Rows as verl's preprocessing scripts write them (gsm8k.py, math_dataset.py)."""
    return [
        {
            "data_source": source,
            "prompt": [{"role": "user", "content": f"what is {i} plus {i + 1} ?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i + 1)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(count)
    ]


def write_parquet(path, rows):
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def test_verl_parquet_is_read_as_it_is(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", verl_rows(5))
    records = check_dataset([path], DataConfig(), key="data.train_files")
    assert len(records) == 5
    first = records[0]
    assert first.messages == [{"role": "user", "content": "what is 0 plus 1 ?"}]
    assert first.ground_truth == "1" and first.data_source == "toy/add"
    assert first.extra_info == {"split": "train", "index": 0}
    assert (first.file, first.row) == (path, 0)


def test_several_files_plain_text_prompts_and_renamed_columns(tmp_path):
    jsonl = tmp_path / "extra.jsonl"
    jsonl.write_text(
        json.dumps({"question": "what is 3 plus 4 ?", "solution": {"value": 7}}) + "\n\n"
        + json.dumps({"question": "what is 1 plus 1 ?", "solution": {"value": 2}}) + "\n"
    )  # fmt: skip
    data = DataConfig(prompt_key="question", answer_key="solution.value")
    records = check_dataset([str(jsonl)], data, key="data.train_files")
    assert [r.messages[0]["content"] for r in records] == [
        "what is 3 plus 4 ?",
        "what is 1 plus 1 ?",
    ]
    assert [r.ground_truth for r in records] == [7, 2]
    assert records[0].data_source == "extra" and records[0].extra_info is None  # file stem
    both = check_dataset(
        [write_parquet(tmp_path / "a.parquet", verl_rows(2)), str(tmp_path / "a.parquet")],
        DataConfig(),
        key="data.train_files",
    )
    assert len(both) == 4


def test_chat_template_system_prompt_and_max_prompt_length(tmp_path):
    tok = build_tokenizer()
    rows = verl_rows(3)
    rows[2]["prompt"] = [{"role": "user", "content": " ".join(["plus"] * 40)}]  # 50 tokens
    path = write_parquet(tmp_path / "t.parquet", rows)
    data = DataConfig(system_prompt="be brief", max_prompt_length=20)
    dataset = load_dataset([path], data, tok, key="data.train_files")
    assert (len(dataset), dataset.filtered, dataset.truncated) == (2, 1, 0)
    text = tok.decode(dataset.records[0].prompt_ids)
    assert text.startswith("system : be brief") and text.endswith("assistant :")
    expected = tok.apply_chat_template(
        [{"role": "system", "content": "be brief"}, *rows[0]["prompt"]],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert dataset.records[0].prompt_ids == list(expected)
    full = load_dataset([path], DataConfig(max_prompt_length=1024), tok, key="k").records[2]
    left = load_dataset([path], DataConfig(max_prompt_length=20, truncation="left"), tok, key="k")
    right = load_dataset([path], DataConfig(max_prompt_length=20, truncation="right"), tok, key="k")
    assert left.truncated == right.truncated == 1 and left.filtered == 0
    assert left.records[2].prompt_ids == full.prompt_ids[-20:]
    assert right.records[2].prompt_ids == full.prompt_ids[:20]
    with pytest.raises(DataFileError, match=r"t\.parquet row 2 has \d+ prompt tokens"):
        load_dataset([path], DataConfig(max_prompt_length=20, truncation="error"), tok, key="k")
    with pytest.raises(DataFileError, match="every one of 3 prompts is longer"):
        load_dataset([path], DataConfig(max_prompt_length=3), tok, key="k")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: str(d / "missing.parquet"), r"missing\.parquet' does not exist"),
        (lambda d: _write(d / "bad.parquet", b"not parquet"), r"bad\.parquet' is not a readable parquet"),
        (lambda d: _write(d / "x.csv", b"a,b"), "neither parquet nor JSON lines"),
        (lambda d: _empty_parquet(d / "empty.parquet"), r"empty\.parquet holds no rows"),
        (lambda d: _write(d / "bad.jsonl", b'{"prompt": "x"}\n{oops\n'), r"bad\.jsonl:2: not valid JSON"),
    ],
)  # fmt: skip
def test_bad_files_name_the_file(tmp_path, make, message):
    with pytest.raises(DataFileError, match=message):
        check_dataset([make(tmp_path)], DataConfig(), key="data.train_files")


def _empty_parquet(path) -> str:
    """verl's columns, no rows."""
    import datasets

    datasets.Dataset.from_list(verl_rows(2)).select([]).to_parquet(str(path))
    return str(path)


def _write(path, content: bytes) -> str:
    path.write_bytes(content)
    return str(path)


def test_missing_columns_name_the_file_and_column(tmp_path):
    rows = [{k: v for k, v in r.items() if k != "reward_model"} for r in verl_rows(2)]
    path = write_parquet(tmp_path / "noanswer.parquet", rows)
    with pytest.raises(DataFileError, match=r"noanswer\.parquet has no column 'reward_model'"):
        check_dataset([path], DataConfig(), key="data.train_files")
    path = write_parquet(tmp_path / "t.parquet", verl_rows(2))
    with pytest.raises(DataFileError, match=r"has no column 'question' \(data\.prompt_key"):
        check_dataset([path], DataConfig(prompt_key="question"), key="data.val_files")
    with pytest.raises(DataFileError, match=r"row 0: no field 'reward_model.answer'"):
        check_dataset([path], DataConfig(answer_key="reward_model.answer"), key="k")
    bad = verl_rows(2)
    bad[1]["prompt"] = [{"role": "user"}]
    with pytest.raises(DataFileError, match=r"row 1: column 'prompt' holds a message"):
        check_dataset([write_parquet(tmp_path / "m.parquet", bad)], DataConfig(), key="k")


def test_prompt_stream_is_a_seeded_shuffle_per_epoch(tmp_path):
    tok = build_tokenizer()
    path = write_parquet(tmp_path / "t.parquet", verl_rows(7))
    dataset = load_dataset([path], DataConfig(), tok, key="k")
    stream = PromptStream(dataset, seed=5)
    epochs = [stream.order(e) for e in range(3)]
    assert all(sorted(order) == list(range(7)) for order in epochs)  # each epoch: every row once
    assert len(set(epochs)) == 3  # a new shuffle per epoch
    assert PromptStream(dataset, seed=5).order(1) == epochs[1]  # a function of (seed, epoch)
    assert PromptStream(dataset, seed=6).order(1) != epochs[1]
    # position-addressed: a step that takes more prompts does not change what later positions hold
    whole = stream.rows(0, 17)
    assert stream.rows(0, 3) + stream.rows(3, 9) + stream.rows(12, 5) == whole
    assert whole == [*epochs[0], *epochs[1], *epochs[2][:3]]
    assert [r.row for r in stream.take(5, 4)] == whole[5:9]
    assert PromptStream(dataset, seed=5, shuffle=False).rows(5, 4) == [5, 6, 0, 1]


def test_config_keys_and_conflicts():
    config = RunConfig.from_dict({"data": {"train_files": "a.parquet"}})
    assert config.data.train_files == ["a.parquet"] and config.data.max_prompt_length == 1024
    bad = [
        ({"data": {"train_files": []}}, "data.train_files must be a path or a non-empty list"),
        ({"data": {"truncation": "middle"}}, "data.truncation must be one of"),
        ({"data": {"max_prompt_length": 0}}, "data.max_prompt_length must be an int >= 1"),
        ({"reward": {"num_workers": -1}}, "reward.num_workers must be an int >= 0"),
        ({"reward": {"on_error": "skip"}}, "reward.on_error must be one of"),
        ({"eval": {"samples_per_prompt": 0}}, "eval.samples_per_prompt must be an int >= 1"),
        ({"eval": {"every": 2}}, "eval.every needs data.val_files"),
        ({"logging": {"backends": ["jsonl", "comet"]}}, "logging.backends must be one of"),
        ({"logging": {"backends": ["tensorboard"]}}, "that includes 'jsonl'"),
        (
            {"data": {"train_files": "a.parquet"}, "rollout": {"task": "arithmetic"}},
            r"data\.train_files and rollout\.task 'arithmetic'",
        ),
        (
            {"reward": {"function": "math"}, "rollout": {"task": "jsonl:p.jsonl"}},
            r"reward\.function and rollout\.task 'jsonl:p\.jsonl'",
        ),
    ]
    for data, message in bad:
        with pytest.raises(ValueError, match=message):
            RunConfig.from_dict(data)
