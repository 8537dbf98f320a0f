"""The vLLM engine process of `rl-engine bench rollout --engine vllm`
(rl_engine/benchmarks/vllm_engine.py): its prompts cycle to the batch. The process itself runs
in test_rollout_vllm.py (it needs vLLM)."""

from __future__ import annotations

from rl_engine.benchmarks import vllm_engine


def test_prompts_cycle_to_the_batch():
    prompts = [[3, 4], [5]]
    assert vllm_engine.cycled(prompts, 5) == [
        {"prompt_token_ids": ids} for ids in ([3, 4], [5], [3, 4], [5], [3, 4])
    ]


def test_the_two_line_kinds_cannot_be_confused():
    assert not vllm_engine.MODE.startswith(vllm_engine.RESULT)
    assert not vllm_engine.RESULT.startswith(vllm_engine.MODE)
