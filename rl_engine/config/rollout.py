"""The `rollout:` section: the rollout engines (Ray actors), the step's prompts, sampling.

Its sampling keys (max_new_tokens, temperature, top_p, top_k) are inherited from
rl_engine.rollout.sampling.SamplingKeys, which SamplingParams shares: one place names them,
gives their defaults and checks them. The rest configures the job's use of the engines, and
the environment of multi-turn episodes (`env` and the keys after it; rl_engine.envs).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields

from rl_engine.base.fields import (
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_text,
    fail,
)
from rl_engine.rollout.sampling import SamplingKeys
from rl_engine.rollout.speculative.params import SpeculativeParams
from rl_engine.rollout.tp.layout import TENSOR_PARALLEL_SIZES

PLACEMENTS = ("pack", "spread", "strict_spread")
"""Ray placement strategies of the engines (rollout.placement) and ranks (trainer.placement)."""

ASYNC_ORDERS = ("deterministic", "free")
"""Which version generates which step in asynchronous runs (rollout.async_order)."""
ENGINES = ("own", "vllm")
"""The rollout engines a job can run (rollout.engine)."""

ENV_KEYS = ("env", "env_args", "max_turns", "max_total_tokens", "env_timeout_s", "stop_strings")
"""The keys of multi-turn episodes (rollout.env and what only it reads)."""

__all__ = ["ENGINES", "ENV_KEYS", "PLACEMENTS", "TENSOR_PARALLEL_SIZES", "RolloutConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig(SamplingKeys):
    """Rollout engines and sampling (frozen, as SamplingKeys: SamplingParams is hashable)."""

    engine: str = "own"
    """'own' (rl_engine's engine) or 'vllm' (vLLM's CPU build with rl_engine's plugin: the
    trainer's model and sampler inside vLLM, the same tokens and logprobs; docs/rollouts.md)."""
    num_engines: int = 1
    """Number of rollout engines (Ray actors)."""
    max_batch_size: int = 8
    """Most sequences one engine decodes at once."""
    share_prompt_prefill: bool = True
    """Samples of one prompt share one prefill (its KV rows copied into each sample's slot);
    tokens and logprobs stay bit for bit those of a prefill per sample."""
    prompts_per_step: int = 4
    """Prompts sampled per training step."""
    samples_per_prompt: int = 4
    """Completions per prompt: the GRPO group size."""
    task: str = "count"
    """'count', 'arithmetic', 'module:function' (your reward over the built-in prompts) or
    'jsonl:PATH' (a prompt file, one {"prompt": str, "answer": str} per line). Leave it at
    'count' with data.train_files or reward.function: those then give the prompts / rewards."""
    placement: str = "pack"
    """Where the engines go: 'pack' (few nodes), 'spread' or 'strict_spread' (one per node)."""
    source: str | None = None
    """Rollout file or folder of step_N.jsonl files to train on instead of generating (docs/rollouts.md)."""
    save: bool = False
    """Write each step's completions and rewards to <output_dir>/rollouts/step_N.jsonl."""
    tensor_parallel_size: int = 1
    """Processes one engine is split over (1, 2 or 4): output shards only, so completions and
    logprobs equal the TP = 1 engine's bit for bit (docs/scaling.md). Must divide the model's
    query heads; KV heads may be fewer (replicated); vocabulary and MLP width need not divide."""
    speculative: dict | None = None
    """Speculative decoding on the own engine, exact: {method: ngram | draft_model,
    num_tokens: k} (draft_model also names `model`, a load_model spec with the policy's
    tokenizer; ngram takes ngram_max / ngram_min). The tokens and logprobs stay those of plain
    decoding bit for bit; only the forwards per token fall (rl_engine.rollout.speculative)."""
    max_staleness: int = 0
    """Asynchronous RL: the engines generate the rollouts of steps t+1..t+k while the ranks
    train step t, with weights up to k versions old; the loss is decoupled PPO, and each stale
    sample's logprobs are checked against its own version's weights bit for bit. 0: the
    synchronous job (docs/usage.md, "Asynchronous training")."""
    async_order: str = "deterministic"
    """Which version generates which step under max_staleness >= 1. 'deterministic': step s's
    rollouts by the version after step s-k-1 (a function of the step: equal runs, exact
    resume). 'free': the generation beside a step stops once the ranks are done and the next
    step's rollouts exist: no wait for the rest of the window, not reproducible."""
    filter_groups: bool = False
    """DAPO's dynamic sampling: drop the groups whose rewards are all equal (no learning
    signal) and generate groups for more prompts until prompts_per_step groups are kept."""
    filter_groups_max_tries: int = 4
    """Most generation rounds of prompts_per_step prompts one step makes under filter_groups
    (the first included). A step still short after them is filled with the dropped groups in
    order (counted in rollout/filter_filled)."""
    env: str | None = None
    """An environment class, 'path/to/file.py:Class' or 'module:Class' (the shipped ones:
    'rl_engine.envs.calculator:Calculator', 'rl_engine.envs.guess_number:GuessNumber'): each
    sample becomes an episode of model turns and the environment's observations, rewarded by
    the environment (rl_engine.envs). null: one completion per sample."""
    env_args: dict = field(default_factory=dict)
    """Keyword arguments of the environment class: one instance per episode, Class(**env_args)."""
    max_turns: int = 4
    """Most model turns of an episode (rollout.env)."""
    max_total_tokens: int = 1024
    """Most tokens of an episode, prompt and observations included: its longest sequence
    (rollout.env). The model's turn that reaches it is cut there, an observation that would
    pass it is dropped, and the episode ends (counted in env/truncated)."""
    env_timeout_s: float = 10.0
    """Most seconds one call of the environment (constructor, reset, step) may take; a call
    that raises or runs longer is counted (env/errors, env/timeouts) and scored 0, and its
    episode ends (rollout.env)."""
    stop_strings: list = field(default_factory=list)
    """Texts that end a model turn (e.g. ['</calc>']): the turn is cut after the token that
    completes one (rollout.env; needs a model with a tokenizer)."""

    def __post_init__(self) -> None:
        for name in ("num_engines", "max_batch_size", "prompts_per_step", "samples_per_prompt"):
            check_int(f"rollout.{name}", getattr(self, name), 1)
        self.check_sampling_keys("rollout.")
        check_choice("rollout.engine", self.engine, ENGINES)
        check_text("rollout.task", self.task)
        check_choice("rollout.placement", self.placement, PLACEMENTS)
        if self.source is not None:
            check_text("rollout.source", self.source)
        check_bool("rollout.share_prompt_prefill", self.share_prompt_prefill)
        check_bool("rollout.save", self.save)
        check_bool("rollout.filter_groups", self.filter_groups)
        check_choice(
            "rollout.tensor_parallel_size", self.tensor_parallel_size, TENSOR_PARALLEL_SIZES
        )
        check_int("rollout.filter_groups_max_tries", self.filter_groups_max_tries, 1)
        check_int("rollout.max_staleness", self.max_staleness, 0)
        check_choice("rollout.async_order", self.async_order, ASYNC_ORDERS)
        if self.speculative is not None:
            SpeculativeParams.from_dict(self.speculative)
        self._check_env_keys()

    @property
    def speculative_params(self) -> SpeculativeParams | None:
        """rollout.speculative as the engine takes it (None: off)."""
        if self.speculative is None:
            return None
        return SpeculativeParams.from_dict(self.speculative)

    def _check_env_keys(self) -> None:
        if self.env is not None:
            check_text("rollout.env", self.env)
        if not isinstance(self.env_args, dict) or not all(
            isinstance(k, str) for k in self.env_args
        ):
            fail("rollout.env_args", "a mapping of argument names to values", self.env_args)
        check_int("rollout.max_turns", self.max_turns, 1)
        check_int("rollout.max_total_tokens", self.max_total_tokens, 2)
        check_number("rollout.env_timeout_s", self.env_timeout_s, low=0.0, low_open=True)
        strings = self.stop_strings
        if not isinstance(strings, list) or not all(isinstance(t, str) and t for t in strings):
            fail("rollout.stop_strings", "a list of non-empty strings", strings)
        if self.env is None:
            self._check_no_env_keys()

    def _check_no_env_keys(self) -> None:
        """The episode keys mean nothing without an environment: setting one is a mistake."""
        for key in fields(self):
            if key.name not in ENV_KEYS[1:]:
                continue
            default = key.default_factory() if key.default is MISSING else key.default
            if getattr(self, key.name) != default:
                raise ValueError(
                    f"rollout.{key.name} is read only with rollout.env (an environment's "
                    "episodes); set rollout.env or leave it at its default"
                )
