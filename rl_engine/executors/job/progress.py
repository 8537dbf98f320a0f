"""How the job shows its progress: a tqdm bar on a terminal, one plain line per step otherwise."""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("rl_engine.job")


def summary_line(m: dict) -> str:
    parity = (
        f"parity exact {m['parity/exact_match_fraction']:.4f} (max |dlogp| "
        f"{m['parity/max_abs_diff']:.2e}, {m['parity/num_tokens']} tok) | "
        if "parity/num_tokens" in m
        else ""
    )
    skipped = f" | update SKIPPED ({m['skip_reason']})" if m.get("skipped_update") else ""
    return (
        f"step {m['step']:>3} | reward {m['reward_mean']:.3f} | {parity}loss {m['loss']:+.4f} "
        f"| kl {m['kl']:.2e} | {m['time/step']:.1f}s{skipped}"
    )


class StepProgress:
    """Steps done out of `total`; a bar with reward and parity when stderr is a terminal."""

    def __init__(self, total: int, done: int, *, tty: bool | None = None):
        self._bar = self._redirect = None
        if sys.stderr.isatty() if tty is None else tty:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = tqdm(total=total, initial=done, unit="step", desc="train", file=sys.stderr)
            self._redirect = logging_redirect_tqdm()  # log lines print above the bar
            self._redirect.__enter__()

    def update(self, metrics: dict) -> None:
        if self._bar is None:
            log.info(summary_line(metrics))
            return
        postfix = {"reward": f"{metrics['reward_mean']:.3f}"}
        if "parity/exact_match_fraction" in metrics:
            postfix["parity"] = f"{metrics['parity/exact_match_fraction']:.4f}"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._redirect.__exit__(None, None, None)
            self._bar.close()
