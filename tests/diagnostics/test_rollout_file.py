"""`rl-engine diagnose --rollouts`: a real foreign engine (HF generate) vs. the project's own engine.

Chain: the project's invariant RolloutEngine records logprobs that equal the
trainer's recompute bit for bit, so its file diagnoses exact (1.0, exit 0).
Negative control: HF `generate` (plain decode with a KV cache) on the same
weights in bf16 does not (exact-match fraction < 1.0, exit 1).
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from rl_engine.cli import main
from rl_engine.diagnostics.rollout_file import recompute
from rl_engine.models import load_model
from rl_engine.patching import apply_batch_invariant
from rl_engine.rollout import RolloutEngine, SamplingParams, read_rollouts, write_rollouts
from tests.helpers.foreign_engine import hf_completions

MODEL, TEMPERATURE = "tiny-llama", 0.8


def _prompts(count: int = 3, length: int = 6) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 1000) for _ in range(length)] for _ in range(count)]


@pytest.fixture(scope="module")
def hf_file(tmp_path_factory):
    """Completions of HF generate on tiny-llama in bf16 (2 per prompt), as a rollout file."""
    completions = hf_completions(
        MODEL,
        torch.bfloat16,
        _prompts(),
        samples_per_prompt=2,
        max_new_tokens=10,
        temperature=TEMPERATURE,
        seed=0,
    )
    return write_rollouts(tmp_path_factory.mktemp("hf") / "hf.jsonl", completions)


def _diagnose(path, out, *extra) -> tuple[int, dict]:
    argv = ["diagnose", "--rollouts", str(path), "--model", MODEL, "--output-dir", str(out)]
    code = main([*argv, *extra])
    report = out / "report.json"
    return code, json.loads(report.read_text()) if report.exists() else {}


def test_hf_generate_in_bf16_is_not_exact_and_the_report_says_how_far(hf_file, tmp_path):
    code, data = _diagnose(hf_file, tmp_path, "--dtype", "bfloat16")
    invariant, plain = data["modes"]["batch_invariant=true"], data["modes"]["batch_invariant=false"]
    assert code == 1
    assert invariant["metrics"]["exact_match_fraction"] < 1.0  # HF's decode path != trainer's
    assert plain["metrics"]["exact_match_fraction"] < 1.0
    assert invariant["metrics"]["num_tokens"] == sum(
        len(c.token_ids) for c in read_rollouts(hf_file)
    )
    ratios = invariant["ratios"]
    assert ratios["token"]["min"] <= ratios["token"]["quantiles"]["0.5"] <= ratios["token"]["max"]
    assert (
        set(ratios["token"]["outside"])
        == set(ratios["sequence"]["outside"])
        == {"1.5", "2.0", "5.0"}
    )
    assert len(invariant["by_position"]["mean_abs_diff"]) == 10
    worst = invariant["worst_tokens"][0]
    assert worst["line"].startswith("hf.jsonl:") and worst["trainer"] != worst["rollout"]
    assert data["source"]["logprob_temperatures"] == [TEMPERATURE]
    assert "| true |" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "mismatch.png").stat().st_size > 0


def test_the_projects_invariant_engine_diagnoses_exact(tmp_path):
    model, _ = load_model(MODEL, dtype=torch.bfloat16)
    apply_batch_invariant(model)
    sampling = SamplingParams(max_new_tokens=10, temperature=TEMPERATURE, n=2, seed=1)
    completions = RolloutEngine(model, device="cpu", max_batch_size=3).generate(
        _prompts(), sampling
    )
    assert {c.logprob_temperature for c in completions} == {TEMPERATURE}
    path = write_rollouts(tmp_path / "own.jsonl", completions)
    code, data = _diagnose(path, tmp_path / "report", "--dtype", "bfloat16")
    assert code == 0
    assert data["modes"]["batch_invariant=true"]["metrics"]["exact_match_fraction"] == 1.0
    assert data["modes"]["batch_invariant=true"]["worst_tokens"] == []  # no token differs


def test_recompute_never_materialises_full_vocabulary_logits(hf_file):
    """The recompute goes through hidden states + linear_logp: the LM-head module never runs."""
    completions = read_rollouts(hf_file)
    model, _ = load_model(MODEL, dtype=torch.bfloat16)
    for patch in (False, True):
        if patch:
            apply_batch_invariant(model)
        calls = []
        head = model.get_output_embeddings()
        hook = head.register_forward_hook(lambda *a, calls=calls: calls.append(1))
        scores = recompute(model, completions)
        hook.remove()
        assert calls == [] and [s.shape[0] for s in scores] == [
            len(c.token_ids) for c in completions
        ]


def test_malformed_lines_exit_2_with_their_line_numbers_or_are_skipped(hf_file, tmp_path, caplog):
    lines = hf_file.read_text().splitlines()
    bad = json.loads(lines[1])
    bad["token_ids"][0] = 5000  # outside tiny-llama's 1000-token vocabulary
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([lines[0], json.dumps(bad), "{oops", *lines[2:]]) + "\n")
    code, data = _diagnose(path, tmp_path / "strict")
    assert code == 2 and data == {}, "nothing is computed from a file with malformed lines"
    assert "bad.jsonl:2: token_ids[0] = 5000 is outside the vocabulary" in caplog.text
    assert "bad.jsonl:3: bad JSON" in caplog.text and "2 malformed rollout line(s)" in caplog.text
    code, data = _diagnose(path, tmp_path / "skipped", "--skip-bad-lines", "--dtype", "bfloat16")
    assert code == 1 and data["source"]["bad_lines_skipped"] == 2
    assert data["source"]["lines_used"] == len(lines) - 1


def test_usage_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["diagnose", "--rollouts", str(tmp_path / "r.jsonl")])
    assert exit_.value.code == 2 and "needs --model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["diagnose", "--rollouts", "r.jsonl", "--model", MODEL, "--dtype", "float16"])
    assert main(["diagnose", "--rollouts", str(tmp_path / "none.jsonl"), "--model", MODEL]) == 2


def test_multi_turn_records_compare_only_the_policys_tokens(tmp_path):
    """Episodes of the invariant engine with 3-id observations, written with their policy_mask:
    exact (exit 0) over the policy's tokens alone. An observation's logprob entry is ignored
    (changed: still exact); a policy token's is not (changed: exit 1, reported at its place in
    token_ids); without the mask the observations are compared too, and differ."""
    from rl_engine.envs import EpisodeLimits, TurnCodec, run_episodes
    from rl_engine.envs.files import write_episodes
    from tests.helpers.envs.scripted import Answer, engine_turns

    model, _ = load_model(MODEL, dtype=torch.float32)
    apply_batch_invariant(model)
    engine = RolloutEngine(model, device="cpu", max_batch_size=3)
    sampling = SamplingParams(max_new_tokens=4, temperature=TEMPERATURE, seed=1)
    episodes = run_episodes(
        [{"prompt_ids": p} for p in _prompts()],
        2,
        engine_turns(engine, sampling),
        make_env=lambda: Answer(length=3),
        codec=TurnCodec(None, model.config.vocab_size),
        limits=EpisodeLimits(max_turns=3, max_total_tokens=64, timeout_s=10.0),
    )
    path = write_episodes(tmp_path / "episodes.jsonl", episodes)
    code, data = _diagnose(path, tmp_path / "exact")
    metrics = data["modes"]["batch_invariant=true"]["metrics"]
    assert code == 0 and metrics["exact_match_fraction"] == 1.0
    assert metrics["num_tokens"] == sum(sum(e.policy_mask) for e in episodes)

    lines = [json.loads(line) for line in path.read_text().splitlines()]
    observation = lines[0]["policy_mask"].index(0)
    lines[0]["logprobs"][observation] = -42.0
    changed = tmp_path / "observation.jsonl"
    changed.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert _diagnose(changed, tmp_path / "observation")[0] == 0

    policy = lines[0]["policy_mask"].index(1, observation)  # a turn after an observation
    lines[0]["logprobs"][policy] -= 1.0
    changed.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, data = _diagnose(changed, tmp_path / "policy")
    worst = data["modes"]["batch_invariant=true"]["worst_tokens"]
    assert code == 1 and [w["position"] for w in worst] == [policy]

    for line in lines:
        del line["policy_mask"]
    changed.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert _diagnose(changed, tmp_path / "unmasked")[0] == 1
