"""The frozen base a LoRA run's checkpoint was trained on: its record beside the checkpoint and
the check on resume (plain DeepSpeed checkpoints and layout-free ones alike)."""

from __future__ import annotations

import json
from pathlib import Path

LORA_BASE_FILE = "lora_base.json"
"""In a LoRA run's checkpoint tag: {"model": the base's spec, "hash": its content hash}."""


def check_base(directory: Path, tag: str | None, base: dict | None) -> None:
    """The checkpoint's LoRA base record against this run's (`base`, None without LoRA)."""
    latest = directory / "latest"
    if tag is None and not latest.is_file():
        return  # no checkpoint: load_checkpoint says so
    folder = directory / (tag or latest.read_text().strip())
    record = folder / LORA_BASE_FILE
    saved = json.loads(record.read_text()) if record.is_file() else None
    if saved == base or (saved is not None and base is not None and saved["hash"] == base["hash"]):
        return
    if base is None:
        raise ValueError(
            f"checkpoint {str(folder)!r} holds LoRA adapters (of base {saved['model']!r}) but "
            "this run has lora.rank 0: resume with the run's lora: section"
        )
    if saved is None:
        raise ValueError(
            f"lora.rank > 0 but checkpoint {str(folder)!r} is a full fine-tuning one (no "
            f"{LORA_BASE_FILE}): resume it with lora.rank 0"
        )
    raise ValueError(
        f"lora: checkpoint {str(folder)!r} holds adapters of base {saved['model']!r} (content "
        f"hash {saved['hash']}), but this run's model {base['model']!r} has hash {base['hash']}: "
        "resume on the base the adapters were trained on"
    )
