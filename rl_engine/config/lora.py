"""The `lora:` section: a LoRA adapter on the policy (rl_engine/patching/lora.py builds it with PEFT).

PPO's critic carries an adapter of its own with the same keys (executors/worker/critic.py).

Whether a listed target exists needs the model, so that check runs where the model is
loaded (`rl_engine.patching.lora.resolve_targets`, called before Ray starts by the job's
preflight); this section checks what it can without the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from rl_engine.base.fields import check_int, check_number, check_text, fail

ALL_LINEAR = "all-linear"


@dataclass(kw_only=True, slots=True)
class LoraConfig:
    """A LoRA adapter on every target linear of the policy; the base weights stay frozen."""

    rank: int = 0
    """The adapter's rank r (A is r x in, B is out x r); 0 = no adapter (full fine-tuning)."""
    alpha: float = 32
    """The adapter's output is scaled by alpha / rank."""
    target_modules: str | list[str] = ALL_LINEAR
    """'all-linear' (every projection but the vocabulary head, the routers and MoE gates; on
    mixture-of-experts families attention and shared-expert linears) or a list of module names,
    e.g. [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]."""
    dropout: float = 0.0
    """Must be 0.0: dropout draws fresh noise in training that sampling never saw, so the
    trainer's logprobs could never equal the rollout's."""

    def __post_init__(self) -> None:
        check_int("lora.rank", self.rank, 0)
        check_number("lora.alpha", self.alpha, low=0.0, low_open=True)
        if isinstance(self.target_modules, str):
            if self.target_modules != ALL_LINEAR:
                fail(
                    "lora.target_modules",
                    f"{ALL_LINEAR!r} or a list of module names",
                    self.target_modules,
                )
        elif isinstance(self.target_modules, list) and self.target_modules:
            for name in self.target_modules:
                check_text("lora.target_modules[]", name)
        else:
            fail(
                "lora.target_modules",
                f"{ALL_LINEAR!r} or a non-empty list of module names",
                self.target_modules,
            )
        check_number("lora.dropout", self.dropout, low=0.0)
        if self.dropout > 0:
            raise ValueError(
                f"lora.dropout must be 0.0, got {self.dropout}: dropout draws fresh noise in "
                "training that sampling never saw, so the trainer's logprobs could never equal "
                "the rollout's"
            )

    @property
    def enabled(self) -> bool:
        """True when the policy carries an adapter (rank > 0)."""
        return self.rank > 0

    @property
    def scale(self) -> float:
        """alpha / rank, the factor on the adapter's output."""
        return self.alpha / self.rank
