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


def test_models_warm_refuses_a_model_that_is_not_gguf(caplog, monkeypatch, tmp_path):
    monkeypatch.setenv("RL_ENGINE_CACHE_DIR", str(tmp_path))
    assert main(["models", "warm", "tiny-llama"]) == 2
    assert "'tiny-llama' is not a GGUF model" in caplog.text
    assert list(tmp_path.iterdir()) == []


def test_models_warm_with_the_cache_off_is_not_an_error(capsys, monkeypatch):
    """`make setup` runs it: RL_ENGINE_CACHE_DIR=off must not fail the setup."""
    monkeypatch.setenv("RL_ENGINE_CACHE_DIR", "off")
    assert main(["models", "warm", "smollm2-135m-instruct"]) == 0
    assert "the model cache is off" in capsys.readouterr().out
