"""The prompt stream (rl_engine/data/stream.py): stream position -> prompt, one seeded shuffle per
epoch (a function of (seed, epoch) alone), positions independent of how steps slice them; bad
positions, counts and epochs are errors naming the argument."""

from __future__ import annotations

import pytest

from rl_engine.config import DataConfig
from rl_engine.data import PromptDataset, PromptRecord, PromptStream, load_dataset
from rl_engine.data.stream import epoch_seed
from tests.helpers.chat_model import build_tokenizer
from tests.helpers.data import verl_rows, write_parquet


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


def dataset(size: int) -> PromptDataset:
    records = [
        PromptRecord([{"role": "user", "content": str(i)}], str(i), "s", row=i) for i in range(size)
    ]
    return PromptDataset(records)


def test_epoch_seed_is_a_63_bit_function_of_seed_and_epoch():
    seeds = {epoch_seed(s, e) for s in range(5) for e in range(5)}
    assert len(seeds) == 25 and all(0 <= x < 2**63 for x in seeds)
    assert epoch_seed(3, 1) == epoch_seed(3, 1) != epoch_seed(1, 3)


def test_epochs_and_positions():
    stream = PromptStream(dataset(3), seed=0)
    assert len(stream) == 3 and [stream.epoch_of(p) for p in (0, 2, 3, 7)] == [0, 0, 1, 2]
    assert stream.rows(4, 0) == []
    assert [r.row for r in stream.take(0, 3)] == list(stream.order(0))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s: s.order(-1), "epoch must be an int >= 0, got -1"),
        (lambda s: s.order(True), "epoch must be an int >= 0, got True"),
        (lambda s: s.rows(-1, 2), "position must be an int >= 0, got -1"),
        (lambda s: s.rows(0, 1.5), "count must be an int >= 0, got 1.5"),
    ],
)
def test_bad_arguments_name_themselves(call, message):
    with pytest.raises(ValueError, match=message):
        call(PromptStream(dataset(2), seed=0))


def test_an_empty_dataset_has_no_stream():
    with pytest.raises(ValueError, match="a PromptStream needs at least one prompt"):
        PromptStream(dataset(0), seed=0)
