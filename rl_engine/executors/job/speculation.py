"""The step's speculation figures: the engines' draft counts, read and reset once a step."""

from __future__ import annotations

from rl_engine.executors.job.faults import ActorInfo, gather
from rl_engine.executors.job.rollouts import engine_leads
from rl_engine.rollout.speculative import SpeculationCounts


def speculation_metrics(engines: list[ActorInfo]) -> dict:
    """rollout/spec_accept_rate (accepted / proposed drafts) and rollout/spec_tokens_per_forward
    (tokens a sequence gained per verifying forward; 1.0 = plain decoding) over every engine's
    generation since the last call."""
    total = SpeculationCounts()
    calls = [(e, e.handle.take_speculation.remote()) for e in engine_leads(engines)]
    for counts in gather(calls):
        if counts is not None:
            total.add(SpeculationCounts(**counts))
    return {
        "rollout/spec_accept_rate": total.accept_rate,
        "rollout/spec_tokens_per_forward": total.tokens_per_forward,
    }
