"""The command line's errors: a bad config names the key or the file, exit code 2."""

from rl_engine.cli import main


def test_cli_rejects_unknown_config_keys_naming_them(tmp_path, caplog):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: tiny-llama\nrollout:\n  max_batch: 4\n")
    assert main(["train", "--config", str(bad)]) == 2
    assert "rollout.max_batch" in caplog.text


def test_cli_missing_config_file(tmp_path, caplog):
    assert main(["diagnose", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in caplog.text
