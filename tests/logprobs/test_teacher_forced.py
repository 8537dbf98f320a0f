"""THE trainer logprob (rl_engine/logprobs/teacher_forced.py): the definition spelled out op by
op, the same bits for a sequence alone, left-padded in a batch and packed, padding scored 0, and
the input errors. Negative control: the unpatched model's padded batch differs from it alone."""

import pytest
import torch

from rl_engine.kernels import get_op
from rl_engine.logprobs import (
    final_hidden_states,
    packed_token_logprobs,
    scored_targets,
    token_logprobs,
)
from rl_engine.logprobs.packing import right_padded
from rl_engine.models import load_model
from rl_engine.patching import apply_batch_invariant

LENGTHS = (9, 23, 2, 17)


def _model(dtype, patched=True):
    model, _ = load_model("tiny-llama", dtype=dtype)
    if patched:
        apply_batch_invariant(model)
    return model.eval()


def _sequences(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g) for n in LENGTHS]


def _left_padded(seqs):
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :], mask[i, width - len(s) :] = s, 1
    return ids, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_is_the_definition_op_by_op(dtype, temperature):
    """final norm -> lm_head (fp32 logits) -> / T -> log_softmax -> the target's entry."""
    model = _model(dtype)
    ids = _sequences(model.config.vocab_size)[1][None]
    with torch.no_grad():
        got = token_logprobs(model, ids, temperature=temperature)
        hidden = final_hidden_states(model, ids)[:, :-1]
        logits = get_op("lm_head", "cpu")(hidden, model.lm_head.weight)
        logp = get_op("log_softmax", "cpu")(logits.float() / temperature)
        want = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert got.dtype == torch.float32 and got.shape == (1, LENGTHS[1] - 1)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_alone_left_padded_right_padded_and_packed_give_the_same_bits(dtype):
    model = _model(dtype)
    seqs = _sequences(model.config.vocab_size)
    with torch.no_grad():
        alone = [token_logprobs(model, s[None])[0] for s in seqs]
        left = token_logprobs(model, *_left_padded(seqs))
        right = token_logprobs(model, *right_padded(seqs))
        packed = packed_token_logprobs(model, seqs)
    width = left.shape[1]
    for i, (a, n) in enumerate(zip(alone, LENGTHS)):
        assert torch.equal(left[i, width - (n - 1) :], a), i
        assert torch.equal(left[i, : width - (n - 1)], torch.zeros(width - (n - 1))), i
        assert torch.equal(right[i, : n - 1], a) and not right[i, n - 1 :].any(), i
        assert torch.equal(packed[i], a), i


def test_negative_control_the_unpatched_model_depends_on_the_batch():
    model = _model(torch.bfloat16, patched=False)
    seqs = _sequences(model.config.vocab_size)
    with torch.no_grad():
        alone = [token_logprobs(model, s[None])[0] for s in seqs]
        left = token_logprobs(model, *_left_padded(seqs))
    width = left.shape[1]
    same = [
        torch.equal(left[i, width - (n - 1) :], a) for i, (a, n) in enumerate(zip(alone, LENGTHS))
    ]
    assert not all(same), "plain bf16 became batch-invariant: re-check the negative control"


def test_scored_targets_ignore_padding():
    ids = torch.tensor([[0, 5, 6, 7], [3, 4, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
    assert scored_targets(ids, mask).tolist() == [[-100, 6, 7], [4, -100, -100]]


@pytest.mark.parametrize(
    ("ids", "mask", "message"),
    [
        (torch.zeros(5, dtype=torch.long), None, r"input_ids must be \(batch, seq_len\)"),
        (torch.zeros(2, 1, dtype=torch.long), None, "at least 2 tokens per row"),
        (torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 3), "attention_mask shape"),
    ],
)
def test_bad_inputs_name_the_problem(ids, mask, message):
    with pytest.raises(ValueError, match=message):
        token_logprobs(_model(torch.float32), ids, mask)


def test_packed_refuses_a_one_token_sequence():
    with pytest.raises(ValueError, match=r"at least 2 tokens to score one, got lengths \[3, 1\]"):
        packed_token_logprobs(_model(torch.float32), [[1, 2, 3], [4]])
