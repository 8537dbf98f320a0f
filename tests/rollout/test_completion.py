"""A request while it is generated and the Completion it becomes.

What it checks: a request finishes on the first stop or EOS token (kept as its last token,
reason "stop") or at its budget (its own `max_new_tokens`, else the sampling's, reason
"length"), never before; `length` counts prompt and sampled tokens; only a request that may
share names a share key; the completion copies its ids (later appends do not reach it) and
holds its logprobs as fp32 with exactly the appended values.
"""

from __future__ import annotations

import torch

from rl_engine.rollout import SamplingParams
from rl_engine.rollout.completion import Completion, Request


def _request(**kwargs) -> Request:
    return Request(0, 1, [5, 6, 7], key=0, **kwargs)


def test_a_stop_token_finishes_the_request_and_is_kept():
    request, sampling = _request(), SamplingParams(max_new_tokens=5, stop_token_ids=(9,))
    request.append(4, -1.0, sampling)
    assert not request.finished and request.length == 4
    request.append(9, -2.0, sampling)
    assert request.finish_reason == "stop" and request.token_ids == [4, 9]


def test_the_eos_token_finishes_the_request_like_a_stop_token():
    request = _request()
    request.append(2, -0.5, SamplingParams(max_new_tokens=5, eos_token_id=2))
    assert request.finish_reason == "stop"


def test_the_budget_is_the_requests_own_else_the_samplings():
    sampling = SamplingParams(max_new_tokens=3)
    own, default = _request(max_new_tokens=2), _request()
    for step in range(3):
        for request in (own, default):
            if not request.finished:
                request.append(10 + step, -1.0, sampling)
    assert (own.token_ids, own.finish_reason) == ([10, 11], "length")
    assert (default.token_ids, default.finish_reason) == ([10, 11, 12], "length")


def test_only_a_request_that_shares_has_a_share_key():
    assert _request().share_key == (5, 6, 7)
    assert _request(shares_prefill=False).share_key is None


def test_the_completion_copies_the_request_and_keeps_its_logprobs_exactly():
    request, sampling = _request(), SamplingParams(max_new_tokens=2)
    logprobs = [-0.1, -1e-7]  # fp32-representable values round-trip through float exactly
    for token, logprob in zip((4, 8), torch.tensor(logprobs).tolist()):
        request.append(token, logprob, sampling)
    completion = request.completion(weight_version=3, logprob_temperature=0.7)
    assert isinstance(completion, Completion)
    assert (completion.prompt_ids, completion.token_ids) == ([5, 6, 7], [4, 8])
    assert (completion.prompt_index, completion.sample_index) == (0, 1)
    assert (completion.finish_reason, completion.weight_version) == ("length", 3)
    assert completion.logprob_temperature == 0.7 and completion.reward is None
    assert completion.logprobs.dtype == torch.float32
    assert torch.equal(completion.logprobs, torch.tensor(logprobs))
    request.token_ids.append(99)
    request.prompt_ids.append(99)
    assert completion.token_ids == [4, 8] and completion.prompt_ids == [5, 6, 7]
