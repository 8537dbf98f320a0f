"""Scripted environments on token ids (the tiny models have no tokenizer) and a real engine's
turns: what the envs tests and the job tests run episodes with.

The job loads this file by path (`rollout.env: tests/helpers/envs/scripted.py:Faulty`), as a user's
file would be; its classes keep no state outside the instance except `Faulty`'s episode
counter (one per process that plays episodes).
"""

from __future__ import annotations

import itertools
import time

from rl_engine.envs.calculator import Calculator

# ids 0-2 are pad/bos/eos in every tiny config: observations use ids from 3 up
FIRST_ID = 3


class Answer:
    """Answers every model turn with `length` ids (a function of the turn's tokens), reward 1.0
    for each turn with an even first token; done after `turns` answers."""

    def __init__(self, length: int = 1, turns: int = 100):
        self.length, self.turns, self.seen = length, turns, 0

    def reset(self, record):
        self.answer = record.get("answer")
        return None

    def step(self, turn):
        ids = turn["completion_ids"]
        self.seen += 1
        reward = 1.0 if ids[0] % 2 == 0 else 0.0
        observation = [FIRST_ID + (ids[-1] + i) % 50 for i in range(self.length)]
        return observation, reward, self.seen >= self.turns


class Mixed:
    """Answers each model turn with 1 id when its last token is odd, else with 6 (a function
    of the episode alone, whichever process or slot plays it); reward 1.0; never done."""

    def reset(self, record):
        return None

    def step(self, turn):
        last = turn["completion_ids"][-1]
        return [FIRST_ID + (last + i) % 50 for i in range(1 if last % 2 else 6)], 1.0, False


class Faulty:
    """Episode n (counted in the order its process makes them: the engine actor that plays
    it, or the driver for a tensor-parallel engine) behaves by n % 4: 0 answers
    with 2 ids, 1 raises in step, 2 sleeps past any time limit in step, 3 answers with more
    ids than any token budget holds. Rewards: 0.5 per answered turn."""

    counter = itertools.count()

    def __init__(self, hang_s: float = 60.0, flood: int = 10_000):
        self.kind, self.hang_s, self.flood = next(Faulty.counter) % 4, hang_s, flood

    def reset(self, record):
        return None

    def step(self, turn):
        if self.kind == 1:
            raise RuntimeError("the environment broke")
        if self.kind == 2:
            time.sleep(self.hang_s)
        length = self.flood if self.kind == 3 else 2
        return [FIRST_ID + i % 50 for i in range(length)], 0.5, False


def engine_turns(engine, sampling):
    """A `generate_turn` on a RolloutEngine: each turn's transcripts as fresh prompts, n = 1,
    seeded by (sampling.seed, turn)."""
    from dataclasses import replace

    def generate_turn(requests, turn):
        turn_sampling = replace(sampling, n=1, seed=sampling.seed * 1000 + turn)
        return engine.generate([r.ids for r in requests], turn_sampling, progress=False)

    return generate_turn


class CalledCalculator(Calculator):
    """The shipped calculator, but the first turn always counts as a call of the record's
    expression (extra_info['expression']): a random tiny model never writes a call itself, and
    a job should still see the tool's text come back as an observation."""

    def reset(self, record):
        super().reset(record)
        self.expression, self.called = record["extra_info"]["expression"], False

    def step(self, turn):
        if not self.called:
            self.called = True
            return self.result(self.expression), 0.0, False
        return super().step(turn)
