"""Tokenizing prompts (rl_engine/data/tokenize.py): the chat template with the generation prompt
(or the contents joined without one), a system prompt put before a chat that has none, and
data.max_prompt_length enforced by `truncation` (filter, left, right, error), with what was
filtered or cut counted."""

from __future__ import annotations

import pytest

from rl_engine.config import DataConfig
from rl_engine.data import DataFileError, PromptDataset, PromptRecord, encode_messages, load_dataset
from rl_engine.data.tokenize import with_system_prompt
from tests.helpers.chat_model import build_tokenizer
from tests.helpers.data import verl_rows, write_parquet


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


def test_a_system_prompt_goes_first_unless_the_chat_has_one():
    user = [{"role": "user", "content": "hi"}]
    assert with_system_prompt(user, None) is user
    assert with_system_prompt(user, "be brief") == [
        {"role": "system", "content": "be brief"},
        *user,
    ]
    own = [{"role": "system", "content": "mine"}, *user]
    assert with_system_prompt(own, "be brief") is own


def test_without_a_chat_template_the_contents_are_joined():
    """A tokenizer without a chat template (a base model's): the contents, blank-line joined."""
    tokenizer = build_tokenizer()
    assert encode_messages(tokenizer, [{"role": "user", "content": "1 2"}]) != list(
        tokenizer.encode("1 2")
    )  # with its template: the roles and the generation prompt around the content
    tokenizer.chat_template = None
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1 2"}]
    assert encode_messages(tokenizer, messages) == list(tokenizer.encode("be brief\n\n1 2"))


def test_the_dataset_lists_its_sources_in_first_seen_order():
    records = [PromptRecord([], "1", source) for source in ("b", "a", "b", "c")]
    assert PromptDataset(records, filtered=2).data_sources == ["b", "a", "c"]
    assert len(PromptDataset(records)) == 4
