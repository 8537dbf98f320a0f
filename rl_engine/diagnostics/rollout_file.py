"""`rl-engine diagnose --rollouts FILE.jsonl --model SPEC`: another engine's logprobs vs. the trainer's.

Every token of a rollout file (docs/rollouts.md) is recomputed teacher-forced on
the trainer path (decoder hidden states -> `linear_logp`; full-vocabulary logits
are never materialised) at its line's `logprob_temperature`, twice: with plain
torch kernels and with the batch-invariant kernels (the model is patched in
place between the two). Reported, per mode: the parity metrics (exact-match
fraction, max / mean |dlogp|, k3 KL), the importance-ratio distribution
(trainer / rollout: min, max, quantiles, fraction outside [1/C, C] for tokens and
sequences), mismatch by position in the completion, and the worst tokens. Same
files as `diagnose --config`: report.json, report.md, mismatch.png.

Exit status of the CLI: 0 when every token is exact with invariance on, 1 when
not, 2 for unusable input (see rl_engine.cli).

Multi-turn lines (a `policy_mask`, rl_engine.envs.files) are recomputed over the whole
transcript, and only the tokens the policy sampled are compared: the environment's
observations are context. Positions in the report are positions in `token_ids`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rl_engine.config import DTYPES
from rl_engine.diagnostics.report import (
    DiagnosisReport,
    ModeResult,
    plot_report,
    trainer_logprobs,
    write_report,
)
from rl_engine.envs.files import parse_episode_rollouts
from rl_engine.logprobs.packing import plan_micro_batches
from rl_engine.logprobs.parity import THRESHOLDS, mismatch_by_position, mismatch_metrics, ratio_distribution
from rl_engine.rollout.files import BadLine, RolloutFile, RolloutFileError, rollout_files

log = logging.getLogger("rl_engine.diagnose")

# Tokens per recompute forward (packed: no padding): bounds activation memory. Larger
# forwards amortise the invariant kernels' per-call cost: 12 SmolLM2 completions (3,072
# tokens), fp32, invariant, took 1.3-1.8x longer in forwards of 1,024 tokens than of 8,192
# (two runs of the padded layout, shared machine).
TOKENS_PER_FORWARD = 8192
WORST_TOKENS = 10


@dataclass
class RolloutDiagnosisReport(DiagnosisReport):
    """A DiagnosisReport of a rollout file, with the ratio, by-position and worst-token sections."""

    source: str = ""
    lines_used: int = 0
    bad_lines: list[BadLine] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)
    extras: dict[str, dict] = field(default_factory=dict)  # mode key -> ratios, by_position, worst
    seconds: float = 0.0

    @property
    def exact(self) -> bool:
        """Every token equal (torch.equal per token) with invariance on."""
        invariant = next(r for r in self.results if r.batch_invariant)
        return invariant.metrics.exact_match_fraction == 1.0

    def as_dict(self) -> dict:
        data = super().as_dict()
        data["source"] = {
            "path": self.source,
            "lines_used": self.lines_used,
            "bad_lines_skipped": len(self.bad_lines),
            "bad_lines": [str(b) for b in self.bad_lines],
            "logprob_temperatures": self.temperatures,
        }
        for mode, extra in self.extras.items():
            data["modes"][mode].update(extra)
        data["seconds"] = self.seconds
        return data

    def markdown(self) -> str:
        lines = [
            super().markdown(),
            "",
            f"Source: `{self.source}`: {self.lines_used} completions, "
            f"{len(self.bad_lines)} malformed line(s) skipped; logprob temperatures "
            f"{self.temperatures}; recomputed in {self.seconds:.1f} s.",
            "",
            *self._ratio_table(),
            "",
            "Mismatch by position in the completion: see mismatch.png (right).",
        ]
        for mode, extra in self.extras.items():
            lines += ["", *self._worst_table(mode, extra["worst_tokens"])]
        return "\n".join(lines)

    def _ratio_table(self) -> list[str]:
        qs = ("0.01", "0.5", "0.99")
        head = " | ".join(f"p{float(q) * 100:g}" for q in qs)
        outside = " | ".join(f"outside [1/{c:g}, {c:g}]" for c in THRESHOLDS)
        rows = [
            "Importance ratio trainer / rollout = exp(trainer - rollout), per token "
            "(and per sequence: exp of the sum of its token log-ratios):",
            "",
            f"| batch_invariant | min | {head} | max | mean | {outside} | sequences {outside} |",
            "|---|" + "---:|" * (4 + len(qs) + 2 * len(THRESHOLDS)),
        ]
        for mode, extra in self.extras.items():
            tok, seq = extra["ratios"]["token"], extra["ratios"]["sequence"]
            cells = [tok["min"], *(tok["quantiles"][q] for q in qs), tok["max"], tok["mean"]]
            fracs = [tok["outside"][str(c)] for c in THRESHOLDS]
            seq_fracs = [seq["outside"][str(c)] for c in THRESHOLDS]
            rows.append(
                f"| {mode.split('=')[1]} | "
                + " | ".join(f"{v:.9g}" for v in cells)
                + " | "
                + " | ".join(f"{v:.4f}" for v in fracs + seq_fracs)
                + " |"
            )
        return rows

    @staticmethod
    def _worst_table(mode: str, worst: list[dict]) -> list[str]:
        rows = [
            f"Worst tokens, {mode}:",
            "",
            "| line | position | token | rollout logprob | trainer logprob | dlogp |",
            "|---|---:|---|---:|---:|---:|",
        ]
        for w in worst:
            token = f"{w['token_id']}" + (f" `{w['text']!r}`" if w.get("text") is not None else "")
            rows.append(
                f"| {w['line']} | {w['position']} | {token} | {w['rollout']:.9g} | "
                f"{w['trainer']:.9g} | {w['trainer'] - w['rollout']:+.3e} |"
            )
        return rows


def diagnose_rollouts(
    path: str | Path,
    model_spec: str,
    *,
    dtype: str = "float32",
    output_dir: str | Path = "runs/diagnose_rollouts",
    skip_bad_lines: bool = False,
    adapter: str | Path | None = None,
) -> RolloutDiagnosisReport:
    """Recompute every token of the file on the trainer path, invariance off then on; write the report.

    `adapter`: a PEFT adapter folder (`rl-engine export RUN --to DIR`) on the base model
    `model_spec`; with invariance on its layers compute the patched, unmerged LoRA expression
    the rollout engine serves (rl_engine/patching/lora.py).

    Raises RolloutFileError (a ValueError listing every malformed line with its number,
    ids checked against the model's vocabulary) before computing anything, unless
    `skip_bad_lines`; ValueError for an unknown dtype or model, or an adapter that does not
    fit the model (naming its file).
    """
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {list(DTYPES)}, got {dtype!r}")
    rollout_files(path)  # a missing source fails before the model loads
    from rl_engine.models import load_model

    model, tokenizer = load_model(model_spec, dtype=DTYPES[dtype])
    if adapter is not None:
        from rl_engine.patching.lora_adapter import load_adapter

        load_adapter(model, adapter)
    parsed = parse_episode_rollouts(path, vocab_size=model.config.vocab_size)
    parsed = _usable(parsed, skip_bad_lines)
    started = time.perf_counter()
    results, extras = [], {}
    for invariant in (False, True):  # plain first: patching happens in place
        if invariant:
            from rl_engine.patching import apply_batch_invariant

            apply_batch_invariant(model)
        result, extra = _diagnose_mode(model, tokenizer, parsed, invariant)
        results.append(result)
        extras[mode_key(invariant)] = extra
    report = RolloutDiagnosisReport(
        model=str(model_spec),
        dtype=dtype,
        results=results[::-1],
        adapter=None
        if adapter is None
        else str(adapter),  # invariant first, as in diagnose --config
        source=str(path),
        lines_used=len(parsed.completions),
        bad_lines=parsed.bad_lines,
        temperatures=sorted({c.logprob_temperature for c in parsed.completions}),
        extras={key: extras[key] for key in (mode_key(True), mode_key(False))},
        seconds=time.perf_counter() - started,
    )
    write_report(report, Path(output_dir), _plot)
    return report


def _usable(parsed: RolloutFile, skip_bad_lines: bool) -> RolloutFile:
    if parsed.bad_lines and not skip_bad_lines:
        raise RolloutFileError(parsed.bad_lines)
    if parsed.bad_lines:
        log.warning(
            "skipping %d malformed line(s); first: %s", len(parsed.bad_lines), parsed.bad_lines[0]
        )
    if not parsed.completions:
        raise ValueError(
            f"no usable completion in the rollout source ({len(parsed.bad_lines)} malformed lines)"
        )
    return parsed


def recompute(model, completions) -> list[torch.Tensor]:
    """Each completion's logprobs on the trainer path at its own logprob_temperature.

    Sequences of one temperature are packed (`packed_token_logprobs`) into forwards of at
    most TOKENS_PER_FORWARD tokens (a longer sequence gets a forward of its own), grouped by
    `plan_micro_batches`: no padding is computed.
    """
    out: list[torch.Tensor | None] = [None] * len(completions)
    by_temperature: dict[float, list[int]] = {}
    for i, c in enumerate(completions):
        by_temperature.setdefault(c.logprob_temperature, []).append(i)
    for temperature, members in sorted(by_temperature.items()):
        lengths = [_length(completions[i]) for i in members]
        budget = max(TOKENS_PER_FORWARD, max(lengths))
        for group in plan_micro_batches(lengths, max_sequences=len(lengths), max_tokens=budget):
            chunk = [completions[members[j]] for j in group]
            scores = trainer_logprobs(model, chunk, len(chunk), temperature, packing=True)
            for j, score in zip(group, scores):
                out[members[j]] = score
    return out


def _length(c) -> int:
    return len(c.prompt_ids) + len(c.token_ids)


def mode_key(invariant: bool) -> str:
    """The mode's key in report.json, as in diagnose --config."""
    return f"batch_invariant={str(invariant).lower()}"


def policy_positions(c) -> torch.Tensor:
    """The positions in `token_ids` of the tokens the policy sampled (all, without a mask)."""
    mask = getattr(c, "policy_mask", None)
    if mask is None:
        return torch.arange(len(c.token_ids))
    return torch.tensor(mask, dtype=torch.bool).nonzero()[:, 0]


def _diagnose_mode(model, tokenizer, parsed: RolloutFile, invariant: bool):
    completions = parsed.completions
    positions = [policy_positions(c) for c in completions]
    trainer = [t[p] for t, p in zip(recompute(model, completions), positions)]
    rollout = [c.logprobs[p] for c, p in zip(completions, positions)]
    trainer_flat, rollout_flat = torch.cat(trainer), torch.cat(rollout)
    metrics = mismatch_metrics(trainer_flat, rollout_flat)
    log.info(
        "batch_invariant=%s: %d tokens, exact match %.4f",
        invariant,
        metrics.num_tokens,
        metrics.exact_match_fraction,
    )
    diffs = (trainer_flat - rollout_flat).abs().tolist()
    result = ModeResult(invariant, metrics, diffs, modules=[])
    extra = {
        "ratios": ratio_distribution(trainer, rollout),
        "by_position": mismatch_by_position(trainer, rollout),
        "worst_tokens": _worst_tokens(parsed, trainer, positions, tokenizer),
    }
    return result, extra


def _worst_tokens(parsed: RolloutFile, trainer, positions, tokenizer) -> list[dict]:
    """The WORST_TOKENS tokens with the largest |trainer - rollout|, with where they are
    (`trainer[i]`: completion i's logprobs at its policy `positions[i]`)."""
    rows = []
    for c, t, where, (file, line) in zip(parsed.completions, trainer, positions, parsed.sources):
        diff = (t.double() - c.logprobs[where].double()).abs()
        for k in torch.topk(diff, min(WORST_TOKENS, diff.numel())).indices.tolist():
            if diff[k] > 0:
                rows.append((float(diff[k]), file, line, int(where[k]), c, float(t[k])))
    rows.sort(key=lambda r: -r[0])
    worst = []
    for _, file, line, pos, c, trainer_logprob in rows[:WORST_TOKENS]:
        token = c.token_ids[pos]
        worst.append(
            {
                "line": f"{Path(file).name}:{line}",
                "position": pos,
                "token_id": token,
                "text": None if tokenizer is None else tokenizer.decode([token]),
                "rollout": float(c.logprobs[pos]),
                "trainer": trainer_logprob,
            }
        )
    return worst


def _plot(report: RolloutDiagnosisReport, path: Path) -> None:
    def by_position(ax):
        for r in report.results:
            key = mode_key(r.batch_invariant)
            by_pos = report.extras[key]["by_position"]
            ax.plot([max(v, 1e-12) for v in by_pos["mean_abs_diff"]], label=f"{key}: mean")
            ax.plot([max(v, 1e-12) for v in by_pos["max_abs_diff"]], ls=":", label=f"{key}: max")

    plot_report(
        report,
        path,
        f"{Path(report.source).name} vs {report.policy} ({report.dtype})",
        by_position,
        title="|dlogp| by position in the completion (0 shown at 1e-12)",
        xlabel="completion position",
        ylabel="|dlogp|",
    )
