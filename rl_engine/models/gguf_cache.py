"""A GGUF file converted once into a Hugging Face folder, then loaded from it in about a second.

transformers reads a GGUF by parsing its metadata for the config, the weights and the
tokenizer, and de-quantising every tensor (20-40 s for SmolLM2 on 2 cores), in every process
that loads it. The first load writes what that gives (config, float32 safetensors, tokenizer)
to `cache_root()/<gguf stem>-<key>`; later loads read the folder.

- The key is a hash of what determines the result: the GGUF's content (its sha256), the
  versions of transformers, tokenizers, gguf and numpy (they de-quantise and convert), and
  FORMAT_VERSION. The same file in two virtualenvs shares one folder; a changed file gets a
  new one (old ones stay until deleted). A file is hashed once per (resolved path, size,
  mtime): the digest is remembered in `<root>/.gguf_sha256/` (hashing SmolLM2's 92 MB takes
  0.2 s, a multi-GB GGUF seconds), so a file rewritten with its old size and mtime would keep
  its old digest, as a build tool would.
- A folder is published only if, loaded back, it gives the GGUF's model bit for bit
  (torch.equal on every float32 tensor) and a tokenizer that encodes TOKENIZER_PROBES and a
  chat to the same ids; else ModelCacheError and nothing is published.
- It is written into a temp folder beside the target and renamed into place. One process
  converts at a time (an flock on `<key>.lock`, released by the kernel when its holder dies,
  so a killed converter never blocks the next); a process that loses the rename anyway (a
  filesystem without flock) uses the winner's folder.
- Its manifest holds every file's size and sha256; each load checks them (the hash runs beside
  the model load) and raises ModelCacheError naming the folder to delete on a mismatch. It does
  not re-convert: a published folder never changes, so a mismatch is a disk fault or an edit
  the user should hear about, and deleting a folder another process may be reading is unsafe.

`RL_ENGINE_CACHE_DIR` moves the cache (default `~/.cache/rl_engine/models`); `off` turns it off
(every load de-quantises the GGUF again).
"""

from __future__ import annotations

import copy
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl_engine.base.io import write_text_atomic

logger = logging.getLogger(__name__)

CACHE_ENV = "RL_ENGINE_CACHE_DIR"
DEFAULT_CACHE = Path("~/.cache/rl_engine/models")
FORMAT_VERSION = 1
MANIFEST = "rl_engine_manifest.json"
HASH_INDEX = ".gguf_sha256"  # (resolved path, size, mtime) -> the file's sha256, one file each
# Libraries whose code turns the GGUF into tensors and a tokenizer.
_CONVERTERS = ("transformers", "tokenizers", "gguf", "numpy")
# Strings whose ids must not change in the conversion: plain text, whitespace runs, digits,
# non-ASCII, and special tokens written as text.
TOKENIZER_PROBES = (
    "",
    "Hello, world!",
    "What is 7 plus 5? Answer with just the number.",
    "  two leading spaces,\ta tab,\n\nand blank lines\n",
    "12345 + 678 = 13023; 3.14159",
    "naïve café — Tōkyō 東京 🙂",
    "<|im_start|>user\nhi<|im_end|>",
)
PROBE_CHAT = (
    {"role": "system", "content": "You are a careful calculator."},
    {"role": "user", "content": "What is 7 plus 5?"},
    {"role": "assistant", "content": "12"},
    {"role": "user", "content": "And 12 times 3?"},
)


class ModelCacheError(RuntimeError):
    """A converted-model cache folder that does not hold what its GGUF gives."""


def cache_root() -> Path | None:
    """Where converted models go (RL_ENGINE_CACHE_DIR, default ~/.cache/rl_engine/models);
    None when RL_ENGINE_CACHE_DIR=off."""
    value = os.environ.get(CACHE_ENV, "")
    if value.strip().lower() == "off":
        return None
    return Path(value or DEFAULT_CACHE).expanduser()


def cache_key(gguf: Path, root: Path | None = None) -> str:
    """The hash of what the conversion of `gguf` depends on (see the module docstring); the
    file's digest is remembered under `root` when given."""
    inputs = {
        "sha256": content_sha256(gguf, root),
        "format": FORMAT_VERSION,
        "versions": {name: metadata.version(name) for name in _CONVERTERS},
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:20]


def content_sha256(gguf: Path, root: Path | None = None) -> str:
    """The sha256 of the file `gguf`, read from `root`'s index for its (resolved path, size,
    mtime) when it was hashed before, else hashed and (under `root`) written there atomically."""
    resolved = Path(gguf).resolve()
    stat = resolved.stat()
    seen = f"{resolved}\0{stat.st_size}\0{stat.st_mtime_ns}"
    entry = None if root is None else root / HASH_INDEX / hashlib.sha256(seen.encode()).hexdigest()
    if entry is not None and entry.is_file():
        return entry.read_text().strip()
    digest = _sha256(resolved)
    if entry is not None:
        entry.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(entry, digest + "\n")
    return digest


def cache_folder(gguf: Path, root: Path) -> Path:
    return root / f"{Path(gguf).stem}-{cache_key(gguf, root)}"


def published(gguf: Path, root: Path) -> Path | None:
    """The published folder of `gguf` under `root`, or None (manifest not checked)."""
    folder = cache_folder(gguf, root)
    return folder if (folder / MANIFEST).is_file() else None


def folder_has_tokenizer(folder: Path) -> bool:
    return bool(_read_manifest(folder)["has_tokenizer"])


def ensure_converted(gguf: Path, root: Path, with_tokenizer) -> Path:
    """The published folder of `gguf`, converting it first if there is none.
    `with_tokenizer()` says whether the GGUF has a tokenizer (asked only when converting)."""
    target = cache_folder(gguf, root)
    if (target / MANIFEST).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with ConversionLock(target):
        if (target / MANIFEST).is_file():  # another process converted while we waited
            return target
        _remove_stale_temps(target)
        temp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            convert(gguf, temp, with_tokenizer=with_tokenizer())
            return publish(temp, target)
        finally:
            shutil.rmtree(temp, ignore_errors=True)


def load_cached(folder: Path, dtype: torch.dtype):
    """`(model, tokenizer or None)` of a published folder in `dtype`, after its manifest check
    (which hashes the files while transformers reads them)."""
    manifest = _read_manifest(folder)
    with ThreadPoolExecutor(max_workers=1) as pool:
        check = pool.submit(verify_manifest, folder, manifest)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(folder) if manifest["has_tokenizer"] else None
        check.result()  # raises ModelCacheError before the model is handed out
    return model, tokenizer


def convert(gguf: Path, folder: Path, *, with_tokenizer: bool) -> None:
    """Write `gguf` as an HF folder with a manifest, after proving it loads back bit for bit."""
    gguf = Path(gguf)
    logger.info("converting %s to %s (once; later loads read the folder)", gguf, folder)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = None
    if with_tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _save_plain(model, folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    check_same_model(model, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))
    if tokenizer is not None:
        check_same_tokenizer(tokenizer, AutoTokenizer.from_pretrained(folder))
    _write_manifest(folder, gguf, has_tokenizer=tokenizer is not None)


def publish(temp: Path, target: Path) -> Path:
    """Rename `temp` to `target`; if another process published `target` first, drop `temp`
    and use theirs."""
    try:
        os.rename(temp, target)
    except OSError as err:
        if err.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not (target / MANIFEST).is_file():
            raise
        shutil.rmtree(temp, ignore_errors=True)
        logger.info("%s was published by another process; using it", target)
    return target


def check_same_model(expected, loaded) -> None:
    """torch.equal on every state_dict tensor, and the same class; ModelCacheError names the
    first difference."""
    if type(loaded) is not type(expected):
        raise ModelCacheError(
            f"converted model is a {type(loaded).__name__}, not a {type(expected).__name__}"
        )
    want, got = expected.state_dict(), loaded.state_dict()
    if want.keys() != got.keys():
        raise ModelCacheError(
            f"converted model's tensors differ by name: {sorted(want.keys() ^ got.keys())[:5]}"
        )
    for name, tensor in want.items():
        if tensor.dtype != got[name].dtype or not torch.equal(tensor, got[name]):
            raise ModelCacheError(f"converted model's tensor {name!r} differs from the GGUF's")


def check_same_tokenizer(expected, loaded) -> None:
    """The same ids for TOKENIZER_PROBES and PROBE_CHAT, and the same special tokens."""
    for text in TOKENIZER_PROBES:
        if expected(text)["input_ids"] != loaded(text)["input_ids"]:
            raise ModelCacheError(f"converted tokenizer encodes {text!r} differently")
    if expected.special_tokens_map != loaded.special_tokens_map or len(expected) != len(loaded):
        raise ModelCacheError("converted tokenizer's special tokens or vocabulary size differ")
    if expected.chat_template != loaded.chat_template:
        raise ModelCacheError("converted tokenizer's chat template differs")
    if expected.chat_template is not None:
        chat = [dict(message) for message in PROBE_CHAT]
        ids = [
            tok.apply_chat_template(
                chat, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            for tok in (expected, loaded)
        ]
        if ids[0] != ids[1]:
            raise ModelCacheError("converted tokenizer encodes the probe chat differently")


def verify_manifest(folder: Path, manifest: dict | None = None) -> None:
    """Every file the manifest lists has its size and sha256 (ModelCacheError names the folder)."""
    manifest = _read_manifest(folder) if manifest is None else manifest
    for name, want in manifest["files"].items():
        path = folder / name
        size = path.stat().st_size if path.is_file() else None
        if size != want["size"] or _sha256(path) != want["sha256"]:
            raise ModelCacheError(
                f"converted-model cache file {str(path)!r} is not what was published (size or "
                f"sha256 differ): delete the folder {str(folder)!r}; the next load converts "
                "the GGUF again"
            )


def _save_plain(model, folder: Path) -> None:
    # A GGUF-loaded model carries a quantizer that refuses save_pretrained, and a
    # quantization_config that would make from_pretrained look for a .gguf file.
    model.hf_quantizer = None
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model.config = config
    model.save_pretrained(folder)


def _write_manifest(folder: Path, gguf: Path, *, has_tokenizer: bool) -> None:
    files = {
        path.name: {"size": path.stat().st_size, "sha256": _sha256(path)}
        for path in sorted(folder.iterdir())
        if path.is_file()
    }
    manifest = {
        "format": FORMAT_VERSION,
        "gguf": str(gguf.resolve()),
        "key": cache_key(gguf, folder.parent),
        "has_tokenizer": has_tokenizer,
        "files": files,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))


def _read_manifest(folder: Path) -> dict:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        raise ModelCacheError(
            f"converted-model cache folder {str(folder)!r} has no readable {MANIFEST} ({err}): "
            "delete the folder; the next load converts the GGUF again"
        ) from err
    if manifest.get("format") != FORMAT_VERSION or not manifest.get("files"):
        raise ModelCacheError(
            f"{str(folder / MANIFEST)!r} is not a format-{FORMAT_VERSION} manifest: delete {str(folder)!r}"
        )
    return manifest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


class ConversionLock:
    """An exclusive flock on `<target>.lock`: the kernel drops it when the holder exits or is
    killed, so a dead converter never leaves a lock that blocks."""

    def __init__(self, target: Path):
        self.path = target.with_name(f"{target.name}.lock")

    def __enter__(self):
        self.file = open(self.path, "a")  # noqa: SIM115 (held until __exit__)
        fcntl.flock(self.file, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


def _remove_stale_temps(target: Path) -> None:
    # Under the lock no other process writes this key: any temp folder of it is a killed
    # converter's leftover.
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
