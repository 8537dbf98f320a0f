"""Typed run configuration: one dataclass per component, loaded from YAML or a dict.

Every field is checked in `__post_init__`; an invalid value raises a ValueError
that names the field with its section (`trainer.micro_batch_size must be >= 1,
got 0`). Unknown keys are rejected, listed with their section.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from rl_engine.algorithms import ADVANTAGE_ESTIMATORS, AGGREGATIONS, CORRECTION_MODES, RATIO_LEVELS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PARITY_MODES = ("strict", "report", "off")
DEVICES = ("cpu", "cuda")
ALGORITHMS = ("grpo", "ppo")
PLACEMENTS = ("pack", "spread", "strict_spread")
PARITY_SCOPES = ("first", "all")
TENSOR_PARALLEL_SIZES = (1, 2, 4)  # rl_engine.rollout.tp.layout checks the same degrees


def _fail(name: str, requirement: str, value: Any) -> None:
    raise ValueError(f"{name} must be {requirement}, got {value!r}")


def _int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(name, f"an int >= {minimum}", value)


def _number(
    name: str, value: Any, *, low: float, high: float = math.inf, low_open: bool = False
) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value > high or value < low or (low_open and value == low):
        bound = f"> {low}" if low_open else f">= {low}"
        _fail(
            name,
            f"a finite number {bound}" + ("" if high == math.inf else f" and <= {high}"),
            value,
        )


def _choice(name: str, value: Any, options: tuple) -> None:
    if not any(value is o or (type(value) is type(o) and value == o) for o in options):
        _fail(
            name, "true or false" if options == (True, False) else f"one of {list(options)}", value
        )


def _text(name: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        _fail(name, "a non-empty string", value)


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """Rollout engines and sampling."""

    num_engines: int = 1
    """Number of rollout engines (Ray actors)."""
    max_batch_size: int = 8
    """Most sequences one engine decodes at once."""
    prompts_per_step: int = 4
    """Prompts sampled per training step."""
    samples_per_prompt: int = 4
    """Completions per prompt: the GRPO group size."""
    max_new_tokens: int = 16
    """Most tokens sampled per completion."""
    temperature: float = 1.0
    """Sampling temperature (0 = greedy). Rollout logprobs are log_softmax(logits / T) with T
    this temperature (1.0 for greedy); the trainer scores each batch at its own T."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
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
    filter_groups: bool = False
    """DAPO's dynamic sampling: drop the groups whose rewards are all equal (no learning
    signal) and generate groups for more prompts until prompts_per_step groups are kept."""
    filter_groups_max_tries: int = 4
    """Most generation rounds of prompts_per_step prompts one step makes under filter_groups
    (the first included). A step still short after them is filled with the dropped groups in
    order (counted in rollout/filter_filled)."""

    def __post_init__(self) -> None:
        for name in (
            "num_engines",
            "max_batch_size",
            "prompts_per_step",
            "samples_per_prompt",
            "max_new_tokens",
        ):
            _int(f"rollout.{name}", getattr(self, name), 1)
        _number("rollout.temperature", self.temperature, low=0.0)
        _number("rollout.top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _int("rollout.top_k", self.top_k, 0)
        _text("rollout.task", self.task)
        _choice("rollout.placement", self.placement, PLACEMENTS)
        if self.source is not None:
            _text("rollout.source", self.source)
        _choice("rollout.save", self.save, (True, False))
        _choice("rollout.filter_groups", self.filter_groups, (True, False))
        _choice("rollout.tensor_parallel_size", self.tensor_parallel_size, TENSOR_PARALLEL_SIZES)
        _int("rollout.filter_groups_max_tries", self.filter_groups_max_tries, 1)


def _default_deepspeed() -> dict:
    return {"zero_optimization": {"stage": 0}, "steps_per_print": 1_000_000}


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    """DeepSpeed training ranks and the optimizer."""

    num_ranks: int = 1
    """Data-parallel DeepSpeed ranks (WORLD_SIZE)."""
    micro_batch_size: int = 4
    """Sequences per forward/backward on one rank (train_micro_batch_size_per_gpu); with a
    token budget, the most sequences one micro-batch may hold."""
    packing: bool = True
    """Micro-batches as packed rows: a micro-batch's sequences concatenated in one row,
    positions restarting at 0, no padding computed. The logprobs are bitwise those of the
    padded layout (false: right-padded rows, every row as wide as the step's longest)."""
    max_tokens_per_micro_batch: int = 0
    """Token budget of one micro-batch (0 = off: micro_batch_size sequences each). With N > 0
    a micro-batch holds at most N tokens (packed: its sequences' lengths summed; padded: their
    count x the longest) and at most micro_batch_size sequences, assigned by a balanced plan
    that depends on the lengths only; the number of micro-batches then varies per step. A
    sequence longer than N is a BatchError naming both numbers."""
    mini_batch_size: int = 0
    """Sequences per optimizer step, over all ranks (0 = the whole step: one update per RL step,
    as before). The step's batch splits into sequences_per_step / mini_batch_size mini-batches,
    each rank taking its rows of each; every mini-batch is one optimizer step (its own
    accumulation boundary and loss normaliser). The ratio's old logprobs are the rollout's."""
    epochs: int = 1
    """Passes over the step's batch: epochs x mini-batches optimizer steps per RL step."""
    parity_scope: str = "all"
    """Which sequences parity checks, always on a forward of the pre-update policy: 'first'
    (the first mini-batch's, from its training forward: free) or 'all' (also one no-grad
    scoring pass over the other mini-batches before the first update). One mini-batch: the
    same, at no cost. algorithm.rollout_correction other than 'none' always runs the pass."""
    lr: float = 1e-5
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (DeepSpeed gradient_clipping; 0 = off)."""
    deepspeed: dict | str = field(default_factory=_default_deepspeed)
    """DeepSpeed config: a dict or a path to a JSON file (default: ZeRO-0 built in code)."""
    zero_stage: int | None = None
    """Overrides deepspeed.zero_optimization.stage when set (0-3)."""
    placement: str = "pack"
    """Where the ranks go: 'pack' (few nodes), 'spread' or 'strict_spread' (one per node)."""
    collective_timeout_s: float = 600.0
    """A collective that waits longer than this fails with an error instead of hanging (the
    weight group's sends and receives too)."""
    weight_sync_bucket_mb: float = 128.0
    """Most MiB a weight sync moves per bucket (the trainer ranks send their weights straight
    to the engines, a bucket at a time), and most MiB of parameters a ZeRO-3 rank gathers at
    once to export or checkpoint them."""

    def __post_init__(self) -> None:
        _int("trainer.num_ranks", self.num_ranks, 1)
        _int("trainer.micro_batch_size", self.micro_batch_size, 1)
        _choice("trainer.packing", self.packing, (True, False))
        _int("trainer.max_tokens_per_micro_batch", self.max_tokens_per_micro_batch, 0)
        _int("trainer.mini_batch_size", self.mini_batch_size, 0)
        _int("trainer.epochs", self.epochs, 1)
        _choice("trainer.parity_scope", self.parity_scope, PARITY_SCOPES)
        _number("trainer.lr", self.lr, low=0.0, low_open=True)
        _number("trainer.weight_decay", self.weight_decay, low=0.0)
        _number("trainer.grad_clip", self.grad_clip, low=0.0)
        if not isinstance(self.deepspeed, (dict, str)) or self.deepspeed == "":
            _fail("trainer.deepspeed", "a dict or a path to a JSON file", self.deepspeed)
        if self.zero_stage is not None and self.zero_stage not in (0, 1, 2, 3):
            _fail("trainer.zero_stage", "null or one of 0, 1, 2, 3", self.zero_stage)
        _choice("trainer.placement", self.placement, PLACEMENTS)
        _number("trainer.collective_timeout_s", self.collective_timeout_s, low=0.0, low_open=True)
        _number("trainer.weight_sync_bucket_mb", self.weight_sync_bucket_mb, low=0.0, low_open=True)

    @property
    def weight_sync_bucket_bytes(self) -> int:
        """`weight_sync_bucket_mb` in bytes (at least 1)."""
        return max(1, int(self.weight_sync_bucket_mb * 2**20))


def _check_overlong(value: Any) -> None:
    name = "algorithm.overlong_penalty"
    if not isinstance(value, dict) or set(value) != {"buffer", "factor"}:
        _fail(name, "null or a mapping {buffer: int, factor: number}", value)
    _int(f"{name}.buffer", value["buffer"], 1)
    _number(f"{name}.factor", value["factor"], low=0.0)


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    """Policy-gradient loss."""

    name: str = "grpo"
    """The loss family: 'grpo', the clipped surrogate without a critic, or 'ppo', the same
    surrogate with a value model (the `critic:` section) whose values give GAE advantages."""
    advantage: str | None = None
    """Advantage estimator (rl_engine.algorithms.compute_advantages): 'grpo', 'rloo',
    'reinforce_pp', 'reinforce_pp_baseline' or 'gae'. null: 'grpo' under name 'grpo', 'gae'
    under name 'ppo'. 'gae' needs the critic, which only name 'ppo' runs; 'ppo' trains its
    critic for 'gae' only, so it takes no other estimator."""
    gamma: float = 1.0
    """Discount of 'reinforce_pp' returns and of 'gae' (verl's default, 1.0)."""
    lam: float = 1.0
    """GAE's lambda (verl's default, 1.0: advantages are returns minus values)."""
    ratio_level: str = "token"
    """'token': the per-token PPO ratio; 'sequence': GSPO's length-normalised sequence ratio,
    clipped per sequence (pair it with loss_aggregation 'seq-mean-token-mean', as GSPO does)."""
    clip_eps: float = 0.2
    """Lower clip range of the ratio: clip(r, 1 - clip_eps, ...)."""
    clip_eps_high: float | None = None
    """Upper clip range (default: clip_eps; larger for DAPO clip-higher)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to a frozen reference policy (0 = no reference model)."""
    loss_aggregation: str = "token-mean"
    """'token-mean', 'seq-mean-token-mean' or 'seq-mean-token-sum'."""
    normalize_std: bool = True
    """Divide group-centred rewards by the group std (False = Dr. GRPO)."""
    rollout_correction: str = "none"
    """'none', 'token_truncate', 'token_mask', 'sequence_truncate' or 'sequence_mask' (docs/rollouts.md)."""
    correction_threshold: float = 2.0
    """C of the rollout correction: truncate caps the ratio at C; mask drops ratios outside [1/C, C]."""
    router_aux_loss_coef: float = 0.0
    """Weight of the load-balancing loss of a mixture-of-experts policy (HF's formula, from the
    invariant router logits; 0 = none). A dense model with a coefficient > 0 is refused."""
    overlong_penalty: dict | None = None
    """DAPO's soft overlong punishment, added to each completion's reward: {buffer: C (int),
    factor: F} gives 0 up to rollout.max_new_tokens - C tokens, then down to -F linearly over
    the last C (rl_engine.algorithms.overlong_penalty). null: off."""

    def __post_init__(self) -> None:
        _choice("algorithm.name", self.name, ALGORITHMS)
        if self.advantage is None:
            self.advantage = "gae" if self.name == "ppo" else "grpo"
        _choice("algorithm.advantage", self.advantage, ADVANTAGE_ESTIMATORS)
        if self.advantage == "gae" and self.name != "ppo":
            raise ValueError(
                "algorithm.advantage 'gae' needs a critic (per-token values), and "
                f"algorithm.name {self.name!r} has none; set algorithm.name: ppo (the critic: "
                "section) or pick grpo, rloo, reinforce_pp or reinforce_pp_baseline"
            )
        if self.name == "ppo" and self.advantage != "gae":
            raise ValueError(
                f"algorithm.advantage {self.advantage!r} does not use the critic that "
                "algorithm.name 'ppo' trains; use 'gae' (the default under ppo) or name 'grpo'"
            )
        _number("algorithm.gamma", self.gamma, low=0.0, high=1.0)
        _number("algorithm.lam", self.lam, low=0.0, high=1.0)
        _choice("algorithm.ratio_level", self.ratio_level, RATIO_LEVELS)
        _number("algorithm.clip_eps", self.clip_eps, low=0.0, high=0.999999)
        if self.clip_eps_high is not None:
            _number("algorithm.clip_eps_high", self.clip_eps_high, low=0.0)
        _number("algorithm.kl_coef", self.kl_coef, low=0.0)
        _choice("algorithm.loss_aggregation", self.loss_aggregation, AGGREGATIONS)
        _choice("algorithm.normalize_std", self.normalize_std, (True, False))
        _choice("algorithm.rollout_correction", self.rollout_correction, CORRECTION_MODES)
        _number("algorithm.correction_threshold", self.correction_threshold, low=1.0, low_open=True)
        _number("algorithm.router_aux_loss_coef", self.router_aux_loss_coef, low=0.0)
        if self.overlong_penalty is not None:
            _check_overlong(self.overlong_penalty)


@dataclass(kw_only=True, slots=True)
class CriticConfig:
    """The value model of algorithm.name 'ppo' (ignored otherwise): its own DeepSpeed ranks."""

    model: str | None = None
    """`load_model` spec of the critic's backbone. null: the policy's model (same architecture,
    initialised from the policy's weights, tiny models from the run's seed)."""
    lr: float = 1e-5
    """The critic's AdamW learning rate (weight decay and grad clip: the trainer's)."""
    num_ranks: int | None = None
    """Data-parallel DeepSpeed ranks of the critic (their own process group). null: trainer.num_ranks."""
    zero_stage: int | None = None
    """ZeRO stage of the critic (0-3). null: the trainer's (trainer.zero_stage, else its
    deepspeed config's)."""
    value_clip: float = 0.5
    """PPO value clipping (verl's cliprange_value, default 0.5): the new value may move at most
    this far from the rollout-time value before the clipped squared error takes over."""
    warmup_steps: int = 0
    """The first N RL steps train only the critic: the policy's optimizer does not step (its
    forward still runs, so parity is still checked)."""

    def __post_init__(self) -> None:
        if self.model is not None:
            _text("critic.model", self.model)
        _number("critic.lr", self.lr, low=0.0, low_open=True)
        if self.num_ranks is not None:
            _int("critic.num_ranks", self.num_ranks, 1)
        if self.zero_stage is not None and self.zero_stage not in (0, 1, 2, 3):
            _fail("critic.zero_stage", "null or one of 0, 1, 2, 3", self.zero_stage)
        _number("critic.value_clip", self.value_clip, low=0.0, low_open=True)
        _int("critic.warmup_steps", self.warmup_steps, 0)


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """When and what the job checkpoints (always also after the last step)."""

    every: int = 0
    """Checkpoint every this many steps (0 = only after the last step)."""
    keep_last: int = 2
    """Keep this many newest checkpoints; older ones are deleted after a new one is complete."""
    weights_only: bool = False
    """Save only the policy weights (no optimizer state): smaller, exportable, cannot resume."""

    def __post_init__(self) -> None:
        _int("checkpoint.every", self.every, 0)
        _int("checkpoint.keep_last", self.keep_last, 1)
        _choice("checkpoint.weights_only", self.weights_only, (True, False))


TRUNCATIONS = ("filter", "left", "right", "error")
REWARD_ERRORS = ("zero", "fail")
BACKENDS = ("jsonl", "tensorboard", "wandb", "mlflow")


def _files(name: str, value: Any) -> list[str] | None:
    """None, one path or a list of paths -> None or a non-empty list of non-empty strings."""
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(v, str) and v for v in items):
        _fail(name, "a path or a non-empty list of paths (parquet or JSON lines)", value)
    return list(items)


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Prompt datasets in verl's layout (docs/usage.md): parquet or JSON-lines files."""

    train_files: str | list[str] | None = None
    """Training prompts: one or more .parquet / .jsonl / .json files (null: rollout.task's prompts)."""
    val_files: str | list[str] | None = None
    """Held-out prompts the `eval` section scores (null: no evaluation)."""
    prompt_key: str = "prompt"
    """Column of the prompt: a list of chat messages ({role, content}) or plain text."""
    answer_key: str = "reward_model.ground_truth"
    """Column of the ground truth handed to the reward (dotted: a field inside a struct column)."""
    system_prompt: str | None = None
    """A system message put before every prompt that has none."""
    max_prompt_length: int = 1024
    """Most prompt tokens after the chat template; longer prompts are handled by `truncation`."""
    truncation: str = "filter"
    """Prompts over max_prompt_length: 'filter' (dropped), 'left' / 'right' (tokens cut on that
    side), 'error' (a config error naming the row)."""
    shuffle: bool = True
    """Each epoch visits the rows in a shuffled order from (seed, epoch); false: file order."""

    def __post_init__(self) -> None:
        self.train_files = _files("data.train_files", self.train_files)
        self.val_files = _files("data.val_files", self.val_files)
        _text("data.prompt_key", self.prompt_key)
        _text("data.answer_key", self.answer_key)
        if self.system_prompt is not None:
            _text("data.system_prompt", self.system_prompt)
        _int("data.max_prompt_length", self.max_prompt_length, 1)
        _choice("data.truncation", self.truncation, TRUNCATIONS)
        _choice("data.shuffle", self.shuffle, (True, False))


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """How completions are scored when prompts come from `data` (or `reward.function` is set)."""

    function: str | None = None
    """'math' (math-verify), 'gsm8k' ('#### answer'), 'path/to/file.py:compute_score' or
    'module:function' with verl's signature compute_score(data_source, solution_str,
    ground_truth, extra_info=None) -> float | {'score': float, ...}. null: by data_source
    (gsm8k sources: 'gsm8k', anything else: 'math')."""
    kwargs: dict = field(default_factory=dict)
    """Extra keyword arguments for every call of the function (verl's reward_kwargs)."""
    num_workers: int = 0
    """Ray worker processes that score in parallel (0 = in the driver)."""
    timeout_s: float = 10.0
    """Most seconds one sample's score may take; then it counts as timed out."""
    on_error: str = "zero"
    """A score that raises, times out or is not a number: 'zero' (scored 0, counted in
    reward/errors and reward/timeouts) or 'fail' (the step fails, naming the sample)."""

    def __post_init__(self) -> None:
        if self.function is not None:
            _text("reward.function", self.function)
        if not isinstance(self.kwargs, dict) or not all(isinstance(k, str) for k in self.kwargs):
            _fail("reward.kwargs", "a mapping of argument names to values", self.kwargs)
        _int("reward.num_workers", self.num_workers, 0)
        _number("reward.timeout_s", self.timeout_s, low=0.0, low_open=True)
        _choice("reward.on_error", self.on_error, REWARD_ERRORS)


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    """Validation on data.val_files with the rollout engines: at step 0, every N steps, at the end."""

    every: int = 0
    """Evaluate after every this many steps (0: only at step 0 and after the last step)."""
    samples_per_prompt: int = 1
    """k: completions per validation prompt (pass@k and mean@k are over these k)."""
    temperature: float = 0.0
    """Sampling temperature of validation (0 = greedy)."""
    max_new_tokens: int | None = None
    """Most tokens per validation completion (null: rollout.max_new_tokens)."""
    before_train: bool = True
    """Evaluate the initial policy too (its figures go into step 0's row)."""

    def __post_init__(self) -> None:
        _int("eval.every", self.every, 0)
        _int("eval.samples_per_prompt", self.samples_per_prompt, 1)
        _number("eval.temperature", self.temperature, low=0.0)
        if self.max_new_tokens is not None:
            _int("eval.max_new_tokens", self.max_new_tokens, 1)
        _choice("eval.before_train", self.before_train, (True, False))


@dataclass(kw_only=True, slots=True)
class LoggingConfig:
    """Where each step's scalars go besides metrics.jsonl: the same names in every backend."""

    backends: list[str] = field(default_factory=lambda: ["jsonl"])
    """Any of 'jsonl' (RUN_DIR/metrics.jsonl, always on: resume reads it), 'tensorboard'
    (RUN_DIR/tensorboard), 'wandb' (mode from WANDB_MODE; files under RUN_DIR/wandb),
    'mlflow' (MLFLOW_TRACKING_URI, else a file store in RUN_DIR/mlruns)."""
    project: str = "rl_engine"
    """W&B project / MLflow experiment name."""
    experiment_name: str | None = None
    """W&B / MLflow run name (null: the run directory's name)."""

    def __post_init__(self) -> None:
        if isinstance(self.backends, str):
            self.backends = [self.backends]
        if not isinstance(self.backends, list) or not self.backends:
            _fail("logging.backends", f"a non-empty list of {list(BACKENDS)}", self.backends)
        for backend in self.backends:
            _choice("logging.backends", backend, BACKENDS)
        if len(set(self.backends)) != len(self.backends):
            _fail("logging.backends", "a list without repeats", self.backends)
        if "jsonl" not in self.backends:
            _fail(
                "logging.backends",
                "a list that includes 'jsonl' (metrics.jsonl is the run's record: resume and "
                "the summary read it)",
                self.backends,
            )
        _text("logging.project", self.project)
        if self.experiment_name is not None:
            _text("logging.experiment_name", self.experiment_name)


_SECTIONS = {
    "rollout": RolloutConfig,
    "trainer": TrainerConfig,
    "algorithm": AlgorithmConfig,
    "critic": CriticConfig,
    "checkpoint": CheckpointConfig,
    "data": DataConfig,
    "reward": RewardConfig,
    "eval": EvalConfig,
    "logging": LoggingConfig,
}


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """One RL run: model, numerics, and the rollout / trainer / algorithm sections."""

    model: str = "tiny-llama"
    """`rl_engine.models.load_model` spec: tiny config name, smollm2-135m-instruct, or a path."""
    dtype: str = "float32"
    """'float32' or 'bfloat16': policy weights on both sides (DeepSpeed bf16 when bfloat16)."""
    seed: int = 0
    """Seed of the tiny models' weights and of sampling."""
    device: str = "cpu"
    """'cpu' or 'cuda' (no index): each trainer rank uses the GPU of its LOCAL_RANK, each rollout
    engine the GPU Ray assigns it (actors then ask Ray for one GPU each); the device picks the
    kernels' backend (cpu: cpp, cuda: triton)."""
    batch_invariant: bool = True
    """THE flag: patch rollout and trainer with batch-invariant kernels (bitwise parity)."""
    parity: str | None = None
    """'strict' (mismatch raises ParityError), 'report' (metrics only) or 'off' (YAML's unquoted
    `off` reads as false, which means 'off' too). Default: 'strict', or 'report' with
    rollout.source (another engine's logprobs are rarely bitwise equal)."""
    output_dir: str = "runs/default"
    """Where metrics, plots and checkpoints go."""
    steps: int = 10
    """Training steps of the job."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout section."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Trainer section."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Algorithm section."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model of algorithm.name 'ppo'."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint section."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt datasets (verl layout)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward function and its workers."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Validation during training."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Experiment trackers."""

    def __post_init__(self) -> None:
        _text("model", self.model)
        _choice("dtype", self.dtype, tuple(DTYPES))
        _int("seed", self.seed, 0)
        _choice("device", self.device, DEVICES)
        _choice("batch_invariant", self.batch_invariant, (True, False))
        for name, cls in _SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                _fail(name, f"a {cls.__name__}", getattr(self, name))
        if self.parity is False:  # YAML 1.1 reads an unquoted `off` as false
            self.parity = "off"
        if self.parity is None:
            self.parity = "report" if self.rollout.source is not None else "strict"
        _choice("parity", self.parity, PARITY_MODES)
        _text("output_dir", self.output_dir)
        _int("steps", self.steps, 1)
        if self.parity == "strict" and not self.batch_invariant:
            raise ValueError(
                "parity 'strict' needs batch_invariant: true (use parity 'report' or 'off')"
            )
        self._check_prompt_source()
        self._check_token_budget()
        self._check_mini_batches()
        self._check_dapo()
        self._check_critic()

    def _check_prompt_source(self) -> None:
        """data.train_files / reward.function replace rollout.task: setting both is ambiguous."""
        default_task = RolloutConfig().task
        if self.rollout.task != default_task:
            for key, value in (
                ("data.train_files", self.data.train_files),
                ("reward.function", self.reward.function),
            ):
                if value is not None:
                    raise ValueError(
                        f"{key} and rollout.task {self.rollout.task!r} both say where prompts or "
                        f"rewards come from; with {key} set, leave rollout.task at its default "
                        f"({default_task!r})"
                    )
        if self.rollout.source is not None and self.data.train_files is not None:
            raise ValueError(
                "rollout.source and data.train_files both give the training prompts; set one"
            )
        if self.eval.every and self.data.val_files is None:
            raise ValueError("eval.every needs data.val_files (the prompts to evaluate on)")

    def _check_token_budget(self) -> None:
        """trainer.max_tokens_per_micro_batch must hold one full-length sequence."""
        budget, longest = self.trainer.max_tokens_per_micro_batch, self.rollout.max_new_tokens + 1
        if budget and self.rollout.source is None and budget < longest:
            raise ValueError(
                f"trainer.max_tokens_per_micro_batch = {budget} is less than rollout.max_new_tokens"
                f" + 1 = {longest}: a full-length completion with its prompt could never fit"
            )

    def _check_dapo(self) -> None:
        """The overlong buffer lies within the completion limit; filtering needs generation."""
        penalty, limit = self.algorithm.overlong_penalty, self.rollout.max_new_tokens
        if penalty is not None and penalty["buffer"] > limit:
            raise ValueError(
                f"algorithm.overlong_penalty.buffer = {penalty['buffer']} is more than "
                f"rollout.max_new_tokens = {limit}"
            )
        if self.rollout.filter_groups and self.rollout.source is not None:
            raise ValueError(
                "rollout.filter_groups samples more prompts, which rollout.source cannot: "
                "set one of them"
            )

    def _check_critic(self) -> None:
        """The critic's ranks split the step (and its mini-batches) as the trainer's do."""
        if self.algorithm.name != "ppo":
            return
        if self.rollout.source is not None:
            raise ValueError(
                "algorithm.name 'ppo' needs the critic's values of the policy's own rollouts; "
                "rollout.source trains on another engine's: use name 'grpo' with it"
            )
        ranks, micro = self.critic_ranks, self.trainer.micro_batch_size
        mini = self.trainer.mini_batch_size or self.sequences_per_step
        if mini % ranks:
            raise ValueError(
                f"critic.num_ranks = {ranks} must divide the {mini} sequences of each mini-batch"
            )
        if not self.trainer.max_tokens_per_micro_batch and (mini // ranks) % micro:
            raise ValueError(
                f"{mini} sequences per mini-batch / critic.num_ranks = {ranks} must be a multiple "
                f"of trainer.micro_batch_size = {micro} (or set trainer.max_tokens_per_micro_batch)"
            )

    @property
    def critic_ranks(self) -> int:
        """The critic's DeepSpeed ranks: critic.num_ranks, else trainer.num_ranks."""
        return self.critic.num_ranks or self.trainer.num_ranks

    def critic_view(self) -> RunConfig:
        """This config as the critic's worker reads it: the trainer section with the critic's
        ranks, ZeRO stage and learning rate (its micro-batches, packing, token budget,
        mini-batches and epochs stay the trainer's), the model the critic's backbone."""
        from dataclasses import replace

        c = self.critic
        trainer = replace(
            self.trainer,
            num_ranks=self.critic_ranks,
            zero_stage=self.trainer.zero_stage if c.zero_stage is None else c.zero_stage,
            lr=c.lr,
        )
        return replace(self, model=c.model or self.model, trainer=trainer)

    def _check_mini_batches(self) -> None:
        """trainer.mini_batch_size must split the step evenly over the ranks (and micro-batches)."""
        mini, per_step = self.trainer.mini_batch_size, self.sequences_per_step
        if not mini:
            return
        ranks, micro = self.trainer.num_ranks, self.trainer.micro_batch_size
        if mini > per_step or per_step % mini:
            raise ValueError(
                f"trainer.mini_batch_size = {mini} must divide rollout.prompts_per_step x "
                f"rollout.samples_per_prompt = {per_step} sequences per step"
            )
        if mini % ranks:
            raise ValueError(
                f"trainer.mini_batch_size = {mini} must be a multiple of trainer.num_ranks = "
                f"{ranks} (each rank takes mini_batch_size / num_ranks sequences of each)"
            )
        if not self.trainer.max_tokens_per_micro_batch and (mini // ranks) % micro:
            raise ValueError(
                f"trainer.mini_batch_size / trainer.num_ranks = {mini // ranks} must be a "
                f"multiple of trainer.micro_batch_size = {micro} (or set "
                "trainer.max_tokens_per_micro_batch)"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        """`dtype` as a torch.dtype."""
        return DTYPES[self.dtype]

    @property
    def sequences_per_step(self) -> int:
        """Completions trained on per step, over all ranks."""
        return self.rollout.prompts_per_step * self.rollout.samples_per_prompt

    @property
    def sequences_per_rank(self) -> int:
        """Sequences of one rank's shard of a step: sequences_per_step / num_ranks (and, without a
        token budget, a multiple of micro_batch_size). Raises ValueError when that does not divide
        evenly (checked by the trainer, not here: diagnostics use micro_batch_size alone)."""
        per_step, ranks = self.sequences_per_step, self.trainer.num_ranks
        micro = 1 if self.trainer.max_tokens_per_micro_batch else self.trainer.micro_batch_size
        if per_step % (micro * ranks) != 0:
            if self.trainer.max_tokens_per_micro_batch:
                raise ValueError(
                    f"rollout.prompts_per_step x rollout.samples_per_prompt = {per_step} sequences "
                    f"per step must be a multiple of trainer.num_ranks = {ranks} for training"
                )
            raise ValueError(
                f"rollout.prompts_per_step x rollout.samples_per_prompt = {per_step} sequences per step must be "
                f"a multiple of trainer.micro_batch_size x trainer.num_ranks = "
                f"{self.trainer.micro_batch_size} x {ranks} for training"
            )
        return per_step // ranks

    @property
    def mini_batches_per_step(self) -> int:
        """Optimizer steps per epoch of an RL step: sequences_per_step / trainer.mini_batch_size."""
        mini = self.trainer.mini_batch_size
        return self.sequences_per_step // mini if mini else 1

    @property
    def mini_batch_per_rank(self) -> int:
        """Sequences of one rank in one mini-batch (the whole shard without mini-batches)."""
        return self.sequences_per_rank // self.mini_batches_per_step

    @property
    def gradient_accumulation_steps(self) -> int:
        """DeepSpeed's gradient_accumulation_steps: micro-batches per rank per optimizer step,
        mini_batch_per_rank / micro_batch_size (without mini-batches: the whole shard). With a
        token budget the count varies per mini-batch and the worker marks each one's last
        micro-batch itself: then 1 (DeepSpeed divides the loss by this number; the worker's loss
        scale undoes it either way).
        """
        per_rank = self.mini_batch_per_rank
        if self.trainer.max_tokens_per_micro_batch:
            return 1
        return per_rank // self.trainer.micro_batch_size

    @classmethod
    def from_dict(cls, data: dict) -> RunConfig:
        """Build from a plain dict (as read from YAML); unknown keys raise, listed with their section."""
        if not isinstance(data, dict):
            _fail("config", "a mapping", data)
        for name in _SECTIONS:
            if not isinstance(data.get(name, {}), dict):
                _fail(name, "a mapping", data[name])
        unknown = _unknown_keys(cls, data, "")
        for name, section_cls in _SECTIONS.items():
            unknown += _unknown_keys(section_cls, data.get(name, {}), f"{name}.")
        if unknown:
            raise ValueError(f"unknown config keys: {', '.join(unknown)}")
        top = {k: v for k, v in data.items() if k not in _SECTIONS}
        sections = {name: cls_(**data.get(name, {})) for name, cls_ in _SECTIONS.items()}
        return cls(**top, **sections)

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] = ()) -> RunConfig:
        """Read a YAML file (an empty file gives the defaults), then apply `key=value` overrides."""
        data = read_yaml(path)
        return cls.from_dict(apply_overrides({} if data is None else data, overrides))

    def to_dict(self) -> dict:
        return asdict(self)

    def to_yaml(self, path: str | Path) -> None:
        """Write the config as YAML, atomically (a run directory's snapshot is never half-written)."""
        import yaml

        from rl_engine.io import write_text_atomic

        write_text_atomic(path, yaml.safe_dump(self.to_dict(), sort_keys=False))


def _unknown_keys(cls, data: dict, prefix: str) -> list[str]:
    """'section.key (valid: ...)' for every key of `data` that `cls` has no field for."""
    known = sorted(f.name for f in fields(cls))
    return [f"{prefix}{key} (valid: {', '.join(known)})" for key in data if key not in known]


def read_yaml(path: str | Path):
    """The YAML document in `path`; a syntax error names the file, line and column."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"config file {str(path)!r} does not exist") from None
    try:
        return yaml.load(text, Loader=_loader())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"{where}: YAML syntax error: {problem}") from None


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """`data` with each 'dotted.key=value' set; values are parsed as YAML ('1e-5' -> 1e-05)."""
    import copy

    import yaml

    if not isinstance(data, dict):
        _fail("config", "a mapping", data)
    data = copy.deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ValueError(
                f"--set {item!r}: expected key=value with a dotted key, e.g. trainer.lr=1e-5"
            )
        try:
            value = yaml.load(raw, Loader=_loader())
        except yaml.YAMLError as err:
            raise ValueError(
                f"--set {item!r}: the value is not valid YAML ({err.problem})"
            ) from None
        *sections, leaf = key.split(".")
        node = data
        for depth, name in enumerate(sections):
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                where = ".".join(sections[: depth + 1])
                raise ValueError(f"--set {item!r}: {where} is not a section")
        node[leaf] = value
    return data


def _loader():
    """SafeLoader that also reads '1e-5' as a float (YAML 1.1 wants '1.0e-5'; users write both)."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(
            r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[0-9][0-9_]*[eE][-+]?[0-9]+"
            r"|\.[0-9_]+(?:[eE][-+]?[0-9]+)?|\.inf|\.Inf|\.INF|\.nan|\.NaN|\.NAN)$"
        ),
        list("-+0123456789."),
    )
    return Loader
