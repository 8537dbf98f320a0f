"""Typed run configuration: one dataclass per section, loaded from YAML or a dict.

Every field is checked in `__post_init__`; an invalid value raises a ValueError that names the
field with its section (`trainer.micro_batch_size must be an int >= 1, got 0`). Unknown keys are
rejected, listed with their section.

Where things are
----------------
- One module per section, named after its YAML key: `rollout.py`, `trainer.py`,
  `algorithm.py`, `critic.py`, `checkpoint.py`, `data.py`, `reward.py`, `eval.py`,
  `logging.py`, `lora.py`. Each holds the section's dataclass (a one-line docstring under every field)
  and the checks of its own keys; its docstring names the component it configures.
- The sampling keys of `rollout:` (max_new_tokens, temperature, top_p, top_k) live with the
  engine, in rl_engine.rollout.sampling.SamplingKeys: RolloutConfig and the engine's
  SamplingParams both inherit them, so their names, defaults and checks exist once, and a new
  sampling key is added there alone.
- `run.py`: RunConfig (top-level keys, the sections), its batch arithmetic and `critic_view`.
- `cross_checks.py`: checks that span sections (token budget vs. the longest sequence,
  mini-batches vs. ranks, the critic's split, where prompts come from, DAPO, environments).
- `yaml_io.py`: reading YAML, `--set` overrides, unknown-key errors, writing YAML.
- The field checks (`check_int`, `check_number`, ... and the one wording of their errors) are
  rl_engine.base.fields, below every layer, because SamplingParams checks with them too.

Why the other sections stay here rather than inside their components: this package sits above
rollout/ and algorithms/ (it imports their names) and below executors/, diagnostics/,
benchmarks/ and cli.py (they import it). The worker and the job read sections, so their
schemas cannot live in executors/ without an import running upward; algorithms/, data/ and
rewards/ take plain arguments and never read a section, so they stay free of the config.
Only the sampling keys have a reader below the config (the engine), so only they moved down.

`from rl_engine.config import X` keeps working for every name below.
"""

from rl_engine.config.algorithm import ALGORITHMS, TURN_REWARDS, AlgorithmConfig
from rl_engine.config.checkpoint import CheckpointConfig
from rl_engine.config.critic import CriticConfig
from rl_engine.config.data import TRUNCATIONS, DataConfig
from rl_engine.config.eval import EvalConfig
from rl_engine.config.logging import BACKENDS, LoggingConfig
from rl_engine.config.lora import ALL_LINEAR, LoraConfig
from rl_engine.config.reward import REWARD_ERRORS, RewardConfig
from rl_engine.config.rollout import PLACEMENTS, TENSOR_PARALLEL_SIZES, RolloutConfig
from rl_engine.config.run import DEVICES, DTYPES, PARITY_MODES, SECTIONS, RunConfig
from rl_engine.config.trainer import PARITY_SCOPES, TrainerConfig
from rl_engine.config.yaml_io import apply_overrides, read_yaml

__all__ = [
    "ALL_LINEAR",
    "ALGORITHMS",
    "BACKENDS",
    "DEVICES",
    "DTYPES",
    "PARITY_MODES",
    "PARITY_SCOPES",
    "PLACEMENTS",
    "REWARD_ERRORS",
    "SECTIONS",
    "TENSOR_PARALLEL_SIZES",
    "TRUNCATIONS",
    "TURN_REWARDS",
    "AlgorithmConfig",
    "CheckpointConfig",
    "CriticConfig",
    "DataConfig",
    "EvalConfig",
    "LoggingConfig",
    "LoraConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "TrainerConfig",
    "apply_overrides",
    "read_yaml",
]
