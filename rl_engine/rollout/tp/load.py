"""Each TP rank reads only its own rows from safetensors files: a Hugging Face folder
(`model.safetensors` or its shards with `model.safetensors.index.json`) or a job
checkpoint's `weights.safetensors`.

safetensors maps the file, and `get_slice(name)[start:stop]` reads just those rows of a
row-major tensor: a sharded weight costs this rank 1 / N of its bytes; replicated tensors
(embedding, norms, a replicated KV head) are read whole. Tied names stored once (HF omits
a tied `lm_head.weight`; a checkpoint lists its aliases under `rl_engine.aliases`) are
found through the model's tied names.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import nn

from rl_engine.rollout.tp.shard import shard_rows, tied_aliases, weight_targets

ALIASES_KEY = "rl_engine.aliases"  # the metadata key rl_engine's weights files list aliases under
INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(path: str | Path) -> list[Path]:
    """The safetensors files of `path`: the file itself, or a folder's model file(s)."""
    path = Path(path).expanduser()
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"weights path {str(path)!r} does not exist")
    index = path / INDEX_FILE
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / name for name in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"folder {str(path)!r} has no .safetensors file")
    return files


def read_shards(model: nn.Module, path: str | Path) -> tuple[dict[str, torch.Tensor], int]:
    """(every state-dict name of the sharded `model` -> its value on this rank, bytes read).

    Raises ValueError naming the first tensor the files lack or cannot cut."""
    from safetensors import safe_open

    with ExitStack() as stack:
        files = safetensors_files(path)
        handles = [stack.enter_context(safe_open(str(f), framework="pt")) for f in files]
        return _read(model, path, handles, shard_rows(model), tied_aliases(model))


def _read(model, path, handles, rows, aliases) -> tuple[dict[str, torch.Tensor], int]:
    views = set(model.state_dict(keep_vars=True)) - set(weight_targets(model))
    out: dict[str, torch.Tensor] = {}
    read = 0
    where: dict[str, tuple[object, str]] = {}
    for handle in handles:
        stored_as = json.loads((handle.metadata() or {}).get(ALIASES_KEY, "{}"))
        for name in handle.keys():
            where[name] = (handle, name)
        for alias, name in stored_as.items():
            where.setdefault(alias, (handle, name))
    for name in model.state_dict(keep_vars=True):
        source = next((n for n in (name, *aliases.get(name, ())) if n in where), None)
        if source is None:
            raise ValueError(f"the weights at {str(path)!r} have no tensor {name!r}")
        handle, stored = where[source]
        if name in views and source != name and source in out:  # a tied head's rows: a view
            start, stop = rows[name]
            out[name] = out[source][start:stop]
            continue
        if name in rows:
            start, stop = rows[name]
            piece = handle.get_slice(stored)
            length = piece.get_shape()[0] if piece.get_shape() else 0
            if length < stop:
                raise ValueError(
                    f"{stored!r} has {length} rows; this rank holds rows [{start}, {stop}) of {name!r}"
                )
            out[name] = piece[start:stop]
        else:
            out[name] = handle.get_tensor(stored)
        read += out[name].numel() * out[name].element_size()
    return out, read
