"""RunConfig: one RL run's top-level keys, its sections, and the step's batch arithmetic."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from rl_engine.config.algorithm import AlgorithmConfig
from rl_engine.config.checkpoint import CheckpointConfig
from rl_engine.config.critic import CriticConfig
from rl_engine.config.cross_checks import check_run
from rl_engine.config.data import DataConfig
from rl_engine.config.eval import EvalConfig
from rl_engine.config.logging import LoggingConfig
from rl_engine.config.lora import LoraConfig
from rl_engine.config.reward import RewardConfig
from rl_engine.config.rollout import RolloutConfig
from rl_engine.config.trainer import TrainerConfig
from rl_engine.config.yaml_io import apply_overrides, check_keys, read_yaml, write_yaml
from rl_engine.base.fields import check_bool, check_choice, check_int, check_text, fail

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PARITY_MODES = ("strict", "report", "off")
DEVICES = ("cpu", "cuda")

SECTIONS = {
    "rollout": RolloutConfig,
    "trainer": TrainerConfig,
    "algorithm": AlgorithmConfig,
    "critic": CriticConfig,
    "checkpoint": CheckpointConfig,
    "data": DataConfig,
    "reward": RewardConfig,
    "eval": EvalConfig,
    "logging": LoggingConfig,
    "lora": LoraConfig,
}
"""Each section's YAML key and class; a new section is a field of RunConfig and a line here."""


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """One RL run: model, numerics, and the rollout / trainer / algorithm sections."""

    model: str = "tiny-llama"
    """`rl_engine.models.load_model` spec: tiny config name, smollm2-135m-instruct, or a path."""
    adapter: str | None = None
    """`rl-engine diagnose --config` only: a PEFT adapter folder (`rl-engine export RUN --to
    DIR`) on `model`, the policy sampled and scored; a training run refuses it (its adapter
    is the `lora:` section's)."""
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
    lora: LoraConfig = field(default_factory=LoraConfig)
    """A LoRA adapter on the policy (rank 0: none, full fine-tuning)."""

    def __post_init__(self) -> None:
        check_text("model", self.model)
        if self.adapter is not None:
            check_text("adapter", self.adapter)
        check_choice("dtype", self.dtype, tuple(DTYPES))
        check_int("seed", self.seed, 0)
        check_choice("device", self.device, DEVICES)
        check_bool("batch_invariant", self.batch_invariant)
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                fail(name, f"a {cls.__name__}", getattr(self, name))
        self._settle_parity()
        check_text("output_dir", self.output_dir)
        check_int("steps", self.steps, 1)
        if self.parity == "strict" and not self.batch_invariant:
            raise ValueError(
                "parity 'strict' needs batch_invariant: true (use parity 'report' or 'off')"
            )
        check_run(self)

    def _settle_parity(self) -> None:
        """`parity` as one of PARITY_MODES: false reads as 'off', null picks the default."""
        if self.parity is False:  # YAML 1.1 reads an unquoted `off` as false
            self.parity = "off"
        if self.parity is None:
            self.parity = "report" if self.rollout.source is not None else "strict"
        check_choice("parity", self.parity, PARITY_MODES)

    # ------------------------------------------------------------------ the critic's view

    @property
    def critic_ranks(self) -> int:
        """The critic's DeepSpeed ranks: critic.num_ranks, else trainer.num_ranks."""
        return self.critic.num_ranks or self.trainer.num_ranks

    def critic_view(self) -> RunConfig:
        """This config as the critic's worker reads it: the trainer section with the critic's
        ranks, ZeRO stage and learning rate (its micro-batches, packing, token budget,
        mini-batches and epochs stay the trainer's), the model the critic's backbone."""
        c = self.critic
        trainer = replace(
            self.trainer,
            num_ranks=self.critic_ranks,
            zero_stage=self.trainer.zero_stage if c.zero_stage is None else c.zero_stage,
            lr=c.lr,
        )
        return replace(self, model=c.model or self.model, trainer=trainer)

    # ------------------------------------------------------------------ batch arithmetic

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
        micro = 1 if self.trainer.ragged_micro_batches else self.trainer.micro_batch_size
        if per_step % (micro * ranks) != 0:
            if self.trainer.ragged_micro_batches:
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
        token budget (or layout_invariant) the count varies per mini-batch and the worker marks
        each one's last micro-batch itself: then 1 (DeepSpeed divides the loss by this number; the worker's loss
        scale undoes it either way).
        """
        per_rank = self.mini_batch_per_rank
        if self.trainer.ragged_micro_batches:
            return 1
        return per_rank // self.trainer.micro_batch_size

    # ------------------------------------------------------------------ dicts and YAML

    @classmethod
    def from_dict(cls, data: dict) -> RunConfig:
        """Build from a plain dict (as read from YAML); unknown keys raise, listed with their section."""
        check_keys(data, cls, SECTIONS)
        top = {k: v for k, v in data.items() if k not in SECTIONS}
        sections = {name: section(**data.get(name, {})) for name, section in SECTIONS.items()}
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
        write_yaml(path, self.to_dict())
