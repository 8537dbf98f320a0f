"""Tensor-parallel engines give the TP = 1 engine's completions and logprobs bit for bit.

One spawn of 2 ranks runs tiny-llama fp32, tiny-qwen3 bf16 (vocabulary 999: uneven
shards) and tiny-llama-1003 (vocabulary 1003, MLP 201, one KV head replicated), with
continuous batching (10 sequences through 3 slots, stop tokens), uneven prompts
(packed prefills), 1 thread per rank against the test process's own threads; plus the
negative control: the same engine with Megatron's row-parallel o_proj / down_proj
(partial sums all-reduced) differs. The same spawn runs prompt sharing's TP = 2 case
(tests/rollout/test_prompt_sharing.py): sharing on == TP = 1 without sharing, speculating
engines (prompt lookup, a replicated draft model) == TP = 1 without speculation, and the LoRA
cases of tests/rollout/tp/test_shard_lora.py (its docstring says what they check). TP = 4 runs
tiny-mistral (8 query, 4 KV heads).
"""

from __future__ import annotations

import functools

import pytest
import torch

from rl_engine.rollout.tp import launch
from tests.helpers.rollout import tp_lora_procs, tp_procs

pytestmark = [pytest.mark.multiprocess]

TP2 = (
    ("tiny-llama", "fp32"),
    ("tiny-qwen3", "bf16"),
    ("tiny-llama-1003", "fp32"),
    ("tiny-qwen2", "fp32"),  # q/k/v biases, untied head, vocabulary 1031
)
NEGATIVE = ("tiny-llama", "fp32")


@functools.cache
def reference(key: str, dtype: str) -> dict:
    return tp_procs.generate_tp1(key, dtype)


LOADS = (("tiny-llama", "fp32"), ("tiny-qwen2", "bf16"))  # an HF folder, a weights file


SHARING = ("tiny-qwen3", "bf16")  # the prompt-sharing scenario (test_prompt_sharing.py)
LORA = (("tiny-llama", "fp32"), ("tiny-qwen3", "bf16"), ("tiny-llama-1003", "fp32"))


@pytest.fixture(scope="module")
def tp2_world(tmp_path_factory) -> dict:
    """Every TP = 2 run of this module in one spawn of 2 ranks."""
    loads = tuple(
        (key, dtype, tp_procs.save_weights(key, dtype, tmp_path_factory.mktemp(key)))
        for key, dtype in LOADS
    )
    parts = {
        "sharded": functools.partial(tp_procs.generate_sharded, TP2, NEGATIVE, loads=loads),
        "sharing": functools.partial(tp_procs.generate_sharing_on_ranks, *SHARING),
        "lora": functools.partial(tp_lora_procs.lora_sharded, LORA),
        "speculative": tp_procs.generate_speculative,
    }
    return launch(functools.partial(tp_procs.run_parts, parts), 2)


@pytest.fixture(scope="module")
def tp2_runs(tp2_world) -> dict:
    return tp2_world["sharded"]


def assert_same(got: dict, want: dict) -> None:
    assert got["tokens"] == want["tokens"]
    assert got["finish"] == want["finish"]
    assert got["batch_sizes"] == want["batch_sizes"]  # the same schedule, step by step
    for a, b in zip(got["logprobs"], want["logprobs"], strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b)


@pytest.mark.parametrize("scenario", TP2, ids=lambda s: "-".join(s))
def test_tp2_equals_tp1(tp2_runs, scenario):
    assert_same(tp2_runs[scenario], reference(*scenario))


@pytest.mark.parametrize("scenario", TP2[:3], ids=lambda s: "-".join(s))
def test_the_mix_batches_continuously(scenario):
    """The prompts exercise what they should: slots reused mid-run, packed prefills, stops."""
    want = reference(*scenario)
    assert want["admitted_while_running"] > 0 and want["packed_prefills"] > 0
    assert "stop" in want["finish"] and "length" in want["finish"]


@pytest.mark.parametrize("scenario", TP2, ids=lambda s: "-".join(s))
def test_each_tp_rank_receives_only_its_shards(tp2_runs, scenario):
    shares = tp2_runs[scenario]["receiver"]
    ranks = shares["ranks"]
    assert all(r["nbytes"] < shares["manifest"] for r in ranks)
    names = set(ranks[0]["sliced"])
    assert names and all(set(r["sliced"]) == names for r in ranks)
    for name in names:  # the ranks' slices of a tensor add up to it: no overlap, no gap
        assert sum(r["sliced"][name] for r in ranks) == shares["full"][name]
    replicated = ranks[0]["nbytes"] - sum(ranks[0]["sliced"].values())
    assert sum(r["nbytes"] for r in ranks) == shares["manifest"] + replicated


@pytest.mark.parametrize("scenario", LOADS, ids=lambda s: "-".join(s))
def test_each_tp_rank_reads_only_its_rows_of_a_folder_or_weights_file(tp2_runs, scenario):
    """A seed-1 engine that loads seed 0's weights shard by shard generates seed 0's bits."""
    got = tp2_runs[("load", *scenario)]
    assert_same(got, reference(*scenario))
    assert got["versions"] == [5, 5]
    sizes = got["bytes"]
    # each rank reads exactly what it holds (its rows, the replicated tensors), not the file
    assert sizes["read"] == sizes["held"]
    assert all(r < sizes["on_disk"] for r in sizes["read"])


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("scenario", tp_procs.SPECULATIVE, ids=lambda s: "-".join(s))
def test_a_speculating_tp2_engine_equals_tp1_without_speculation(tp2_world, scenario, method):
    """Rank 0 verifies the drafts and broadcasts what it emits; every rank drafts alike."""
    got = tp2_world["speculative"]["/".join((*scenario, method))]
    want = reference(*scenario)
    assert got["tokens"] == want["tokens"] and got["finish"] == want["finish"]
    for a, b in zip(got["logprobs"], want["logprobs"], strict=True):
        assert torch.equal(a, b)
    counts = got["speculation"]
    assert counts.forwards > 0
    if method == "draft_model":  # the policy as its own draft: every draft accepted
        assert counts.proposed > 0 and counts.accepted == counts.proposed


def test_row_parallel_all_reduce_differs(tp2_runs):
    """Negative control: summing partial products across ranks changes the bits."""
    want, got = reference(*NEGATIVE), tp2_runs["row_parallel"]
    first = [a[:1] for a in got["logprobs"]], [b[:1] for b in want["logprobs"]]
    assert not all(torch.equal(a, b) for a, b in zip(*first))


def test_tp2_shares_with_the_bits_of_tp1_without_sharing(tp2_world):
    """Sharing on a TP = 2 engine (each rank copies its own KV heads) == TP = 1 without it."""
    got = tp2_world["sharing"]
    want = tp_procs.generate_sharing(*SHARING, share=False)
    assert got["shared_prefills"] > 0 and want["shared_prefills"] == 0
    assert got["prefill_forwards"] < want["prefill_forwards"]
    assert got["tokens"] == want["tokens"] and got["finish"] == want["finish"]
    assert got["batch_sizes"] == want["batch_sizes"]
    for a, b in zip(got["logprobs"], want["logprobs"], strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------------- LoRA on TP = 2 (test_shard_lora.py)


@functools.cache
def lora_reference(key: str, dtype: str) -> dict:
    return tp_lora_procs.lora_tp1(key, dtype)


@pytest.fixture(scope="module")
def tp2_lora(tp2_world) -> dict:
    return tp2_world["lora"]


def same_lora(got: dict, want: dict) -> bool:
    return got["tokens"] == want["tokens"] and all(
        a.dtype == torch.float32 and torch.equal(a, b)
        for a, b in zip(got["logprobs"], want["logprobs"], strict=True)
    )


@pytest.mark.parametrize("scenario", LORA, ids=lambda s: "-".join(s))
def test_tp2_lora_equals_tp1_before_and_after_a_weight_update(tp2_lora, scenario):
    got, want = tp2_lora[scenario], lora_reference(*scenario)
    for phase in ("first", "after_sync"):
        assert same_lora(got[phase], want[phase]), phase
        assert got[phase]["finish"] == want[phase]["finish"]
        assert got[phase]["batch_sizes"] == want[phase]["batch_sizes"]
    assert want["first"]["tokens"] != want["after_sync"]["tokens"]  # the update mattered


def test_an_engine_that_merges_the_adapters_differs(tp2_lora):
    assert not same_lora(tp2_lora["merged"], lora_reference(*LORA[0])["first"])


@pytest.mark.parametrize("scenario", LORA, ids=lambda s: "-".join(s))
def test_the_weight_plan_sends_each_rank_its_b_rows_and_the_whole_a(tp2_lora, scenario):
    plan = tp2_lora[scenario]["plan"]
    ranks, shapes = plan["ranks"], plan["shapes"]
    a_names = [n for n in plan["adapters"] if ".lora_A." in n]
    b_names = [n for n in plan["adapters"] if ".lora_B." in n]
    assert len(a_names) == len(b_names) == 14
    split = 0
    for b in b_names:
        w = b.replace(".lora_B.default.", ".base_layer.")
        pieces = [r["rows"][b] for r in ranks]
        assert [r["rows"][w] for r in ranks] == pieces  # B's rows are the rows of W it holds
        if pieces[0] is None:  # a replicated output (a lone KV head): whole on every rank
            assert all(p is None for p in pieces)
            continue
        split += 1
        spans = [span for piece in pieces for span in piece]
        assert spans[0][0] == 0 and spans[-1][1] == shapes[b][0]
        assert all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))
    assert split >= 10
    assert all(r["rows"][a] is None for r in ranks for a in a_names)  # A whole everywhere
    for r in ranks:  # an adapters-only sync: the whole A and this rank's B rows, nothing else
        a_bytes = sum(_numel(shapes[a]) * plan["itemsize"][a] for a in a_names)
        b_bytes = sum(_rows_bytes(r["rows"][b], shapes[b], plan["itemsize"][b]) for b in b_names)
        assert r["adapter_nbytes"] == a_bytes + b_bytes < r["nbytes"]


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _rows_bytes(piece, shape, itemsize: int) -> int:
    rows = shape[0] if piece is None else sum(stop - start for start, stop in piece)
    return rows * _numel(shape[1:]) * itemsize


@pytest.mark.slow
def test_tp4_equals_tp1_with_four_kv_heads():
    scenario = ("tiny-mistral", "fp32")
    got = launch(functools.partial(tp_procs.generate_sharded, (scenario,), None), 4)
    assert_same(got[scenario], reference(*scenario))
