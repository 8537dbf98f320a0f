"""`rl-engine diagnose` / scripts/logprob_mismatch.py: rollout vs. trainer, invariance on and off.

For each mode (batch-invariant kernels on, plain torch off) the same prompts are
sampled by the rollout engine, then scored teacher-forced in the trainer's
layout (micro-batches of `trainer.micro_batch_size`, packed into one row each with
`trainer.packing`, else right-padded). Reported: the
exact-match fraction and the usual mismatch metrics over every completion token,
and the first module where decode and prefill disagree; for a mixture-of-experts
model also the routing agreement per sparse layer between the engine's forwards
and the trainer's, and what diverged first in the first divergent layer
(rl_engine/diagnostics/routing.py). Written atomically to
<output_dir>/diagnosis/: report.json, report.md, mismatch.png.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from rl_engine.config import RunConfig
from rl_engine.diagnostics.divergence import (
    ModuleDivergence,
    OutputRecorder,
    compare_traces,
    decode_trace,
    first_divergence,
    prefill_trace,
)
from rl_engine.diagnostics.routing import (
    EngineRoutingTrace,
    RoutingReport,
    compare_routing,
    trainer_routing,
)
from rl_engine.base.io import write_json_atomic, write_text_atomic
from rl_engine.logprobs import (
    final_hidden_states,
    packed_final_hidden_states,
    packed_token_logprobs,
    token_logprobs,
)
from rl_engine.logprobs.packing import PackedBatch, right_padded
from rl_engine.logprobs.parity import MismatchMetrics, mismatch_metrics

log = logging.getLogger("rl_engine.diagnose")


@dataclass
class ModeResult:
    batch_invariant: bool
    metrics: MismatchMetrics
    abs_diffs: list[float] = field(repr=False)
    modules: list[ModuleDivergence] = field(repr=False)
    routing: RoutingReport | None = None
    """Mixture-of-experts models: routing agreement per sparse layer (None for dense models)."""

    @property
    def first_divergence(self) -> ModuleDivergence | None:
        return first_divergence(self.modules)


@dataclass
class DiagnosisReport:
    model: str
    dtype: str
    results: list[ModeResult]
    adapter: str | None = None
    """The PEFT adapter folder on the model, or None."""

    @property
    def policy(self) -> str:
        """The model, with its adapter when there is one."""
        return self.model if self.adapter is None else f"{self.model} + adapter {self.adapter}"

    def markdown(self) -> str:
        lines = [
            f"# Logprob mismatch: {self.policy} ({self.dtype})",
            "",
            "| batch_invariant | tokens | exact match | max abs dlogp | mean abs dlogp | k3 KL | mean abs dprob | first divergence |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in self.results:
            m, fd = r.metrics, r.first_divergence
            where = "none" if fd is None else f"`{fd.name}` (max abs diff {fd.max_abs_diff:.2e})"
            if not r.modules:
                where = "n/a (no engine to trace)"
            if fd is not None and not fd.input_equal:
                source = "the attention kernel" if fd.name.endswith("o_proj") else "a functional op"
                where += f", its input already differed: born in {source} feeding it"
            lines.append(
                f"| {str(r.batch_invariant).lower()} | {m.num_tokens} | {m.exact_match_fraction:.4f} | {m.max_abs_diff:.3e} | "
                f"{m.mean_abs_diff:.3e} | {m.k3_kl:.3e} | {m.mean_abs_prob_diff:.3e} | {where} |"
            )
        if any(r.routing is not None for r in self.results):
            lines += ["", *routing_markdown(self.results)]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {
            "model": self.model,
            "adapter": self.adapter,
            "dtype": self.dtype,
            "modes": {
                f"batch_invariant={str(r.batch_invariant).lower()}": {
                    "metrics": r.metrics.as_dict(),
                    "first_divergence": None
                    if r.first_divergence is None
                    else asdict(r.first_divergence),
                    "modules": [asdict(m) for m in r.modules],
                    "routing": None if r.routing is None else asdict(r.routing),
                }
                for r in self.results
            },
        }


def routing_markdown(results: list[ModeResult]) -> list[str]:
    """The routing-agreement table (one row per sparse layer, one column per mode) and, per mode,
    what diverged first in the first divergent layer."""
    modes = [r for r in results if r.routing is not None]
    head = " | ".join(f"batch_invariant={str(r.batch_invariant).lower()}" for r in modes)
    lines = [
        "## Routing agreement: tokens whose top-k expert list is identical, rollout vs trainer",
        "",
        f"| sparse layer | tokens | {head} |",
        "|---|---:|" + "---:|" * len(modes),
    ]
    for i, layer in enumerate(modes[0].routing.layers):
        cells = " | ".join(f"{r.routing.layers[i].routing_agreement:.4f}" for r in modes)
        lines.append(f"| `{layer.layer}` | {layer.tokens} | {cells} |")
    lines.append("")
    for r in modes:
        rep, mode = r.routing, f"batch_invariant={str(r.batch_invariant).lower()}"
        if rep.first_divergent_layer is None:
            lines.append(f"- {mode}: no sparse layer diverged (logits and experts output equal)")
            continue
        what = (
            f"the router diverged first ({rep.tokens_router_differs} tokens' logits differ"
            if rep.diverged_first == "router"
            else f"the experts diverged first (same logits, {rep.tokens_experts_differ} tokens' "
            "output differs"
        )
        born = (
            "its input was equal: born in the block"
            if rep.input_equal
            else ("its input already differed: born upstream")
        )
        lines.append(
            f"- {mode}: first divergent layer `{rep.first_divergent_layer}`: {what}; {born})"
        )
    return lines


def _load(config: RunConfig, invariant: bool):
    from rl_engine.models import load_model
    from rl_engine.patching import apply_batch_invariant

    model, tokenizer = load_model(config.model, dtype=config.torch_dtype, seed=config.seed)
    if config.adapter is not None:
        from rl_engine.patching.lora import check_adapter_shape
        from rl_engine.patching.lora_adapter import load_adapter

        load_adapter(model, config.adapter)
        if config.lora.enabled:  # a run's config: its adapter must be the run's shape
            check_adapter_shape(model, config.lora.rank, config.lora.scale)
    if invariant:
        apply_batch_invariant(model)
    return model, tokenizer


def _sampling(config: RunConfig, n: int):
    from rl_engine.rollout import SamplingParams

    return SamplingParams.from_config(config.rollout, seed=config.seed, n=n)


def trainer_logprobs(
    model, completions, micro_batch_size: int, temperature: float, *, packing: bool = True
) -> list[torch.Tensor]:
    """Each completion's token logprobs recomputed teacher-forced, in micro-batches of
    `micro_batch_size`: one packed row each (`packed_token_logprobs`), or right-padded."""
    scores = []
    for start in range(0, len(completions), micro_batch_size):
        chunk = completions[start : start + micro_batch_size]
        seqs = [c.prompt_ids + c.token_ids for c in chunk]
        with torch.no_grad():
            if packing:
                rows = packed_token_logprobs(model, seqs, temperature=temperature)
            else:
                ids, mask = right_padded(seqs)
                lp = token_logprobs(model, ids, mask, temperature=temperature)  # (b, T-1)
                rows = [lp[i, : len(s) - 1] for i, s in enumerate(seqs)]
        for row, c in zip(rows, chunk):
            first = len(c.prompt_ids) - 1  # position scoring the first completion token
            scores.append(row[first : first + len(c.token_ids)])
    return scores


def _module_divergence(model, engine, completions, prompts, config) -> list[ModuleDivergence]:
    """Decode trace of completion 0 generated alone vs. its row in a trainer micro-batch
    (packed: the first sequence of the row, so its columns are its positions)."""
    target = completions[0]
    with OutputRecorder(model.base_model) as rec:
        alone = engine.generate(
            [prompts[target.prompt_index]], _sampling(config, 1), progress=False
        )[0]
    positions = len(alone.prompt_ids) + len(alone.token_ids) - 1
    rollout = decode_trace(rec, positions)
    others = [c.prompt_ids + c.token_ids for c in completions[1 : config.trainer.micro_batch_size]]
    ids, mask = right_padded([alone.prompt_ids + alone.token_ids, *others])
    with OutputRecorder(model.base_model) as rec, torch.no_grad():
        if config.trainer.packing:
            p = PackedBatch.from_padded(ids, mask)
            packed_final_hidden_states(model, p.input_ids, p.positions, p.segments)
        else:
            final_hidden_states(model, ids, mask)
    return compare_traces(rollout, prefill_trace(rec, 0, positions))


def diagnose_mode(config: RunConfig, invariant: bool) -> ModeResult:
    from rl_engine.patching import RoutingRecorder, moe_layers
    from rl_engine.rollout import RolloutEngine
    from rl_engine.data.tasks import make_task

    model, tokenizer = _load(config, invariant)
    task = make_task(
        config.rollout.task,
        vocab_size=model.config.vocab_size,
        tokenizer=tokenizer,
        seed=config.seed,
    )
    prompts = task.prompts(config.rollout.prompts_per_step, 0)
    moe = bool(moe_layers(model))
    # the routing trace reads every sequence's prompt from a prefill forward in its own slot:
    # a shared prefill (copied KV rows) has none
    engine = RolloutEngine(
        model,
        device="cpu",
        max_batch_size=config.rollout.max_batch_size,
        share_prompt_prefill=not moe,
    )
    with EngineRoutingTrace(model) if moe else nullcontext() as trace:
        completions = engine.generate(prompts, _sampling(config, config.rollout.samples_per_prompt))
    mbs, packing = config.trainer.micro_batch_size, config.trainer.packing
    temperature = completions[0].logprob_temperature
    with RoutingRecorder(model, inputs=True, experts=True) if moe else nullcontext() as recorder:
        recomputed = trainer_logprobs(model, completions, mbs, temperature, packing=packing)
    routing = None
    if moe:
        trainer_side = trainer_routing(recorder, completions, mbs, packing=packing)
        routing = compare_routing(model, trace.sequences(completions), trainer_side)
    rollout_lp = torch.cat([c.logprobs for c in completions])
    trainer_lp = torch.cat(recomputed)
    modules = _module_divergence(model, engine, completions, prompts, config)
    metrics = mismatch_metrics(trainer_lp, rollout_lp)
    log.info(
        "batch_invariant=%s: %d tokens, exact match %.4f%s",
        invariant,
        metrics.num_tokens,
        metrics.exact_match_fraction,
        "" if routing is None else f", routing agreement >= {routing.min_agreement:.4f}",
    )
    abs_diffs = (trainer_lp - rollout_lp).abs().tolist()
    return ModeResult(invariant, metrics, abs_diffs, modules, routing)


def run_diagnosis(config: RunConfig, output_dir: str | None = None) -> DiagnosisReport:
    results = [diagnose_mode(config, invariant) for invariant in (True, False)]
    report = DiagnosisReport(config.model, config.dtype, results, config.adapter)
    write_report(report, Path(output_dir or Path(config.output_dir) / "diagnosis"), _plot)
    return report


def write_report(report: DiagnosisReport, out: Path, plot) -> None:
    """report.json, report.md (atomic writes) and `plot(report, out / "mismatch.png")`."""
    write_json_atomic(out / "report.json", report.as_dict())
    write_text_atomic(out / "report.md", report.markdown() + "\n")
    plot(report, out / "mismatch.png")
    log.info("report written to %s", out)


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (logged) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib not installed: no mismatch.png (pip install matplotlib)")
        return None
    return plt


def histogram_panel(ax, results: list[ModeResult]) -> None:
    """|trainer - rollout| per token, one histogram per mode, on log-spaced bins."""
    for r in results:
        diffs = [max(d, 1e-12) for d in r.abs_diffs]
        ax.hist(
            diffs,
            bins=[10.0**e for e in range(-12, 1)],
            alpha=0.6,
            label=f"batch_invariant={r.batch_invariant}: {r.metrics.exact_match_fraction:.1%} exact",
        )
    ax.set(
        xscale="log",
        title="|trainer - rollout| per token (0 shown at 1e-12)",
        xlabel="|dlogp|",
        ylabel="tokens",
    )
    ax.legend()


def save_figure(fig, path: Path) -> None:
    """Write the figure atomically (the caller closes it)."""
    tmp = path.with_suffix(".tmp.png")
    fig.tight_layout()
    fig.savefig(tmp, dpi=100)
    tmp.replace(path)


def plot_report(report, path: Path, suptitle: str, draw_right, **right_axes) -> None:
    """Both reports' figure: the per-token histogram (left), `draw_right(ax)` on a log y axis
    labelled by `right_axes` (right); written atomically, skipped without matplotlib."""
    plt = pyplot()
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    histogram_panel(ax1, report.results)
    draw_right(ax2)
    ax2.set(yscale="log", **right_axes)
    ax2.legend()
    fig.suptitle(suptitle)
    save_figure(fig, path)
    plt.close(fig)


def _plot(report: DiagnosisReport, path: Path) -> None:
    def per_module(ax):
        for r in report.results:
            ax.plot(
                [max(m.max_abs_diff, 1e-12) for m in r.modules],
                marker=".",
                label=f"batch_invariant={r.batch_invariant}",
            )

    plot_report(
        report,
        path,
        f"{report.policy} ({report.dtype})",
        per_module,
        title="decode vs prefill, per module (execution order)",
        xlabel="module index",
        ylabel="max |diff| (0 shown at 1e-12)",
    )
