"""The layout-free training state (executors/worker/layout_free/state.py): gathered on one
layout (ranks, ZeRO stage) it resumes on another and continues exactly, on real DeepSpeed ranks
(gloo): three steps in one run == one step, its state saved, then two steps on another layout,
weights, both moments and the step count compared with torch.equal (the negative control of the
layouts themselves, torch's AdamW with DeepSpeed's clip: test_update.py). In-process, a checkpoint
folder without its state is refused with the reason.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.executors.worker.layout_free.state import STATE_FILE, load_layout_free_checkpoint
from tests.helpers.worker.layout_free_runs import assert_same_state, run_layout_free


@pytest.mark.parametrize(
    ("before", "after"),
    [((2, 3), (1, 0)), ((1, 0), (4, 2))],
)
@pytest.mark.exhaustive
def test_a_state_resumes_on_another_layout_and_continues_exactly(tmp_path, before, after):
    dtype = "bfloat16"
    whole = run_layout_free(tmp_path, *before, dtype, steps=3)
    saved = tmp_path / f"state_{before[0]}_{before[1]}.pt"
    run_layout_free(tmp_path, *before, dtype, steps=1, save=str(saved))
    resumed = run_layout_free(tmp_path, *after, dtype, steps=2, first_step=1, resume=str(saved))
    assert_same_state(whole["state"], resumed["state"])


def test_a_checkpoint_without_its_layout_free_state_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no checkpoint in .* \\(no 'latest'\\)"):
        load_layout_free_checkpoint(None, tmp_path, None)
    (tmp_path / "latest").write_text("step_3")
    (tmp_path / "step_3").mkdir()
    with pytest.raises(
        ValueError, match=f"step_3/{STATE_FILE}' does not exist: a layout-invariant"
    ):
        load_layout_free_checkpoint(None, tmp_path, None)
    torch.save({}, tmp_path / "step_3" / "mp_rank_00_model_states.pt")  # DeepSpeed's, not ours
    with pytest.raises(ValueError, match="written with trainer.layout_invariant: false"):
        load_layout_free_checkpoint(None, tmp_path, "step_3")
