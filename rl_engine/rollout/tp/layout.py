"""The sharding plan of a tensor-parallel engine: which output rows each rank computes.

Rule: shard outputs, never reductions. Every weight is split along its OUTPUT
dimension (rows of a (out, in) weight), so every output element is still one
full-K chain computed on one rank, with the bits of the unsharded model; the
ranks then all-gather (copy) the pieces. Concretely, for rank r of N:

- q_proj: query heads [r * Hq / N, (r + 1) * Hq / N) (N must divide Hq);
- k_proj / v_proj: the KV heads those query heads read: an even split when N
  divides Hkv, else (Hkv divides N) the one KV head of the rank's query group,
  replicated on N / Hkv ranks;
- gate_proj / up_proj / down_proj / o_proj and the LM head: near-even ranges
  `[size * r // N, size * (r + 1) // N)`: sizes need not divide by N (a vocabulary
  of 1003 splits 501 + 502), the gathers pad the short pieces and drop the padding;
- embedding and norms: replicated (a masked partial lookup summed across ranks
  would turn -0.0 into +0.0).
"""

from __future__ import annotations

from dataclasses import dataclass

TENSOR_PARALLEL_SIZES = (1, 2, 4)
CONFIG_KEY = "rollout.tensor_parallel_size"


def even_range(size: int, rank: int, world: int) -> tuple[int, int]:
    """Rank `rank`'s share [start, stop) of `size` rows split near-evenly over `world`."""
    return size * rank // world, size * (rank + 1) // world


def check_tensor_parallel_size(size) -> int:
    """`size` if it is a supported degree, else a ValueError naming the config key."""
    if isinstance(size, bool) or not isinstance(size, int) or size not in TENSOR_PARALLEL_SIZES:
        allowed = ", ".join(map(str, TENSOR_PARALLEL_SIZES))
        raise ValueError(f"{CONFIG_KEY} must be one of {allowed}, got {size!r}")
    return size


@dataclass(frozen=True, slots=True)
class TPLayout:
    """The dimensions of a dense decoder that tensor parallelism splits, checked for `world`."""

    world: int
    """Number of ranks (the tensor-parallel degree)."""
    num_heads: int
    """Query heads (num_attention_heads): N must divide it."""
    num_kv_heads: int
    """KV heads (num_key_value_heads): N divides it, or it divides N (then replicated)."""
    head_dim: int
    """Width of one head."""
    intermediate: int
    """MLP width (intermediate_size): any size >= N (uneven shards)."""
    vocab: int
    """Vocabulary size (rows of the LM head): any size >= N (uneven shards)."""

    def __post_init__(self) -> None:
        world = check_tensor_parallel_size(self.world)
        if self.num_heads % world:
            raise ValueError(
                f"{CONFIG_KEY} {world}: the model's query heads (num_attention_heads "
                f"{self.num_heads}) are not divisible by {world}"
            )
        if self.num_kv_heads % world and world % self.num_kv_heads:
            raise ValueError(
                f"{CONFIG_KEY} {world}: the model's KV heads (num_key_value_heads "
                f"{self.num_kv_heads}) neither divide {world} nor are divisible by it"
            )
        for name, size in (("intermediate_size", self.intermediate), ("vocab_size", self.vocab)):
            if size < world:
                raise ValueError(
                    f"{CONFIG_KEY} {world}: the model's {name} {size} has fewer rows than ranks"
                )

    @classmethod
    def from_config(cls, config, world: int) -> TPLayout:
        """The layout of a Hugging Face dense decoder config (raises ValueError naming the
        dimension that does not split, or the model kind that cannot)."""
        for key in ("num_experts", "num_local_experts"):
            if getattr(config, key, None):
                raise ValueError(
                    f"{CONFIG_KEY} {world}: mixture-of-experts models ({key}="
                    f"{getattr(config, key)}) are not supported under tensor parallelism "
                    "(expert parallelism is future work, docs/scaling.md)"
                )
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            world=world,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate=config.intermediate_size,
            vocab=config.vocab_size,
        )

    # ------------------------------------------------------------------ per-rank ranges

    def query_heads(self, rank: int) -> tuple[int, int]:
        per = self.num_heads // self.world
        return rank * per, (rank + 1) * per

    def kv_heads(self, rank: int) -> tuple[int, int]:
        if self.num_kv_heads % self.world == 0:
            per = self.num_kv_heads // self.world
            return rank * per, (rank + 1) * per
        group = self.num_heads // self.num_kv_heads  # query heads per KV head
        first = self.query_heads(rank)[0] // group
        return first, first + 1

    def rows(self, kind: str, rank: int, hidden: int | None = None) -> tuple[int, int]:
        """Output rows [start, stop) of rank `rank` for a weight of kind `kind`:
        'q' | 'kv' (head-aligned), 'mlp' (intermediate), 'vocab', or 'hidden' (o_proj,
        down_proj: `hidden` output rows, split near-evenly)."""
        if kind == "q":
            start, stop = self.query_heads(rank)
            return start * self.head_dim, stop * self.head_dim
        if kind == "kv":
            start, stop = self.kv_heads(rank)
            return start * self.head_dim, stop * self.head_dim
        sizes = {"mlp": self.intermediate, "vocab": self.vocab, "hidden": hidden}
        if kind not in sizes or sizes[kind] is None:
            raise ValueError(f"unknown row kind {kind!r} (or 'hidden' without its size)")
        return even_range(sizes[kind], rank, self.world)

    def widths(self, kind: str, hidden: int | None = None) -> tuple[int, ...]:
        """Every rank's number of rows of kind `kind` (the pieces a gather reassembles)."""
        spans = (self.rows(kind, r, hidden) for r in range(self.world))
        return tuple(stop - start for start, stop in spans)
