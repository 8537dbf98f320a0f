"""The policy's weights as one safetensors file, written tensor by tensor (never the whole model in memory).

safetensors is 8 bytes of little-endian header length, a JSON header (each tensor's
dtype, shape and byte range in the data section, plus string metadata), then the raw
data. The header depends only on names, shapes and dtypes, which are known before any
tensor is gathered, so `WeightsFileWriter` writes it first and then each tensor's bytes
as they arrive (rank 0 under ZeRO-3 holds one bucket at a time). Tied names are stored
once; the others are listed in the metadata under `rl_engine.aliases` and come back as
the same tensor from `read_weights_file`. `safetensors.torch.load_file` reads the file
too (without the aliases).

The file is written under a temporary name and renamed into place when complete.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from rl_engine.base.io import FILE_MODE

WEIGHTS_FILE = "weights.safetensors"
ALIASES_KEY = "rl_engine.aliases"
_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
}


class WeightsFileWriter:
    """Write `entries` [(names, shape, dtype)] in order: `write(tensor)` once per entry, then `close()`."""

    def __init__(self, path: str | Path, entries: list[tuple[tuple[str, ...], tuple, torch.dtype]]):
        self.path = Path(path)
        self._entries, self._next = entries, 0
        header, aliases, offset = {}, {}, 0
        for names, shape, dtype in entries:
            if dtype not in _DTYPES:
                raise ValueError(f"{names[0]!r}: dtype {dtype} cannot be written to safetensors")
            size = _numel(shape) * dtype.itemsize
            header[names[0]] = {
                "dtype": _DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            aliases.update({alias: names[0] for alias in names[1:]})
            offset += size
        header["__metadata__"] = {"format": "pt", ALIASES_KEY: json.dumps(aliases, sort_keys=True)}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned
        self._tmp = self.path.with_name(f".{self.path.name}.tmp")
        self._file = open(self._tmp, "wb")  # noqa: SIM115 - closed by close() / abort()
        self._file.write(struct.pack("<Q", len(text)) + text)

    def write(self, tensor: torch.Tensor) -> None:
        """The next entry's values (copied to CPU if needed)."""
        names, shape, dtype = self._entries[self._next]
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise ValueError(
                f"{names[0]!r}: got {tuple(tensor.shape)} {tensor.dtype}, the header says "
                f"{tuple(shape)} {dtype}"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._file.write(memoryview(data.numpy()))
        self._next += 1

    def close(self) -> Path:
        """Finish the file and rename it into place; raises if an entry was never written."""
        if self._next != len(self._entries):
            self.abort()
            missing = self._entries[self._next][0][0]
            raise ValueError(f"weights file {self.path}: {missing!r} was never written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.chmod(self._tmp, FILE_MODE)
        os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)


def read_weights_file(path: str | Path) -> dict[str, torch.Tensor]:
    """The state dict of a weights file: every name, tied names as one tensor."""
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), framework="pt") as handle:
        aliases = json.loads((handle.metadata() or {}).get(ALIASES_KEY, "{}"))
        for name in handle.keys():
            out[name] = handle.get_tensor(name)
    for alias, name in aliases.items():
        out[alias] = out[name]
    return out


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def save_state_dict(path: str | Path, state_dict: dict[str, torch.Tensor]) -> Path:
    """A whole in-memory state dict as a weights file (tied names: one tensor, stored once)."""
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in state_dict.items():
        groups.setdefault(id(tensor), ([], tensor))[0].append(name)
    entries = [(tuple(names), tuple(t.shape), t.dtype) for names, t in groups.values()]
    writer = WeightsFileWriter(path, entries)
    try:
        for _, tensor in groups.values():
            writer.write(tensor)
    except BaseException:
        writer.abort()
        raise
    return writer.close()
