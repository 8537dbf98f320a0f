"""House rule of the tensor-parallel modules: shard outputs, never reductions.

No module of rl_engine/rollout/tp/ may call a collective that sums across ranks
(all_reduce, reduce, reduce_scatter and their variants): the order of such a sum
changes with the TP degree, and so do the bits. Gathers and broadcasts copy bits.
Negative control: the tests' own Megatron row-parallel layer (tests/helpers/rollout/tp_procs.py)
and a snippet are caught.

The group itself (`ShardGroup`, in a world of one rank here): it refuses to exist without
torch.distributed, and in a world of one every collective hands back its input bits (uneven
gathers across ranks: test_launch.py's vocabularies of 999 and 1003).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import rl_engine.rollout.tp as tp
from rl_engine.rollout.tp.collectives import ShardGroup

TP_PACKAGE = Path(tp.__file__).parent
SUMMING = ("all_reduce", "reduce", "reduce_scatter", "reduce_op", "ReduceOp")


def summing_collectives(source: str) -> list[str]:
    """Every name in `source` that starts a cross-rank sum (called, referenced or imported)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.Name):
            name = node.id
        elif isinstance(node, ast.alias):
            name = node.name.rsplit(".", 1)[-1]
        else:
            continue
        if any(name == s or name.startswith(s + "_") for s in SUMMING):
            found.append(f"{name} (line {getattr(node, 'lineno', '?')})")
    return found


def test_tp_modules_never_sum_across_ranks():
    files = sorted(TP_PACKAGE.glob("*.py"))
    assert len(files) >= 5  # the package itself, not an empty glob
    offenders = {f.name: summing_collectives(f.read_text()) for f in files}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_check_catches_row_parallel_layers():
    control = (Path(__file__).parents[2] / "helpers" / "rollout" / "tp_procs.py").read_text()
    assert any(hit.startswith("all_reduce") for hit in summing_collectives(control))
    snippets = [
        "import torch.distributed as d\nd.reduce_scatter_tensor(out, x)",
        "from torch.distributed import all_reduce",
        "g.all_reduce_coalesced([x])",
        "op = dist.ReduceOp.SUM",
    ]
    for snippet in snippets:
        assert summing_collectives(snippet), snippet
    assert summing_collectives("dist.all_gather(out, x); dist.broadcast(x, 0)") == []


def test_a_group_needs_torch_distributed():
    if dist.is_initialized():
        pytest.skip("an earlier test in this process initialised torch.distributed")
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        ShardGroup()


def test_a_world_of_one_hands_back_its_own_bits(one_rank_group):
    group = ShardGroup()
    assert (group.rank, group.world, group.global_rank(0)) == (0, 1, 0)
    piece = torch.randn(2, 4)
    assert group.gather_last(piece, (4,)) is piece
    assert group.gather_last_to_first(piece, (4,)) is piece
    assert torch.equal(group.broadcast_from_first(piece.clone()), piece)
    assert group.gather_objects({"rank": 0}) == [{"rank": 0}]
    assert (group.sent_layer_bytes, group.sent_logit_bytes) == (0, 0)  # nothing left the rank
