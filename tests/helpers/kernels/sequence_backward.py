"""The layout harness of the layout-invariant backward (spans + sink): five sequences run alone,
padded, in two micro-batches and packed through one op, each parameter's per-sequence partials
recorded by a sink (the sequence-backward tests on cpp, native and triton)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from rl_engine.kernels import get_op
from rl_engine.kernels.common.linear_logp import linear_logp_op
from rl_engine.kernels.common.product_partial import dense
from rl_engine.kernels.common.sequence_spans import SequenceSpans
from rl_engine.kernels.cpp._serving import GEMM
from rl_engine.kernels.cpp.linear import exact_gemm
from rl_engine.kernels.cpp.linear_logp import chunk_logprobs

DTYPES = [torch.float32, torch.bfloat16]
LENGTHS = (70, 5, 33, 1, 64)
INDICES = (3, 7, 8, 12, 20)  # the sequences' canonical indices in the step
IGNORE = -100


class RecordingSink:
    """What the sink protocol receives, keyed by (role, index); each key arrives once, and a
    role's sequences in increasing index (what the canonical tree's holder requires)."""

    placeholder_grads = False

    def __init__(self):
        self.records = {}
        self.last = {}

    def _put(self, key, value):
        assert key not in self.records, f"{key} reported twice"
        role, index = key
        assert index > self.last.get(role, -1), f"{role}: index {index} after {self.last[role]}"
        self.last[role] = index
        self.records[key] = value

    def add(self, param, role, index, partial):
        assert partial.shape == param.shape
        assert partial.dtype == torch.float32
        self._put((role, index), dense(partial))

    def add_rows(self, param, role, index, rows, values):
        assert rows.dtype == torch.int64
        assert torch.equal(rows, torch.unique(rows))  # sorted, unique
        assert values.shape == (rows.numel(), *param.shape[1:])
        assert values.dtype == torch.float32
        self._put((role, index), (rows, values))


@dataclass
class Call:
    """One micro-batch: its (rows, cols) shape, each member's flat token rows, its spans."""

    shape: tuple[int, int]
    members: list[int]  # sequence numbers (positions in LENGTHS)
    rows: list[torch.Tensor]  # flat rows of each member's tokens, in token order
    spans: SequenceSpans
    packed: bool = False
    lengths: tuple[int, ...] = LENGTHS  # every sequence's length (a member's: lengths[member])

    def values(self, width: int, dtype, seed: int, scale: float = 1.0) -> list[torch.Tensor]:
        return per_sequence(width, dtype, seed, scale, self.lengths)

    def positions(self) -> torch.Tensor:
        """(rows, cols) int64: each token's position in its sequence, -1 on padding."""
        out = torch.full(self.shape, -1, dtype=torch.long)
        for rows in self.rows:
            out.view(-1)[rows] = torch.arange(rows.numel())
        return out

    def segments(self) -> torch.Tensor:
        """(rows, cols) int64: each token's member number, -1 on padding."""
        out = torch.full(self.shape, -1, dtype=torch.long)
        for member, rows in enumerate(self.rows):
            out.view(-1)[rows] = member
        return out


def alone(i: int, lengths: tuple[int, ...] = LENGTHS) -> Call:
    n = lengths[i]
    spans = SequenceSpans.from_padding_mask(torch.ones(1, n), [INDICES[i]])
    return Call((1, n), [i], [torch.arange(n)], spans, lengths=lengths)


def padded(order: list[int], left: list[bool], extra: int, lengths=LENGTHS) -> Call:
    T = max(lengths[i] for i in order) + extra
    mask = torch.zeros(len(order), T, dtype=torch.long)
    rows = []
    for b, (i, is_left) in enumerate(zip(order, left)):
        start = T - lengths[i] if is_left else 0
        mask[b, start : start + lengths[i]] = 1
        rows.append(b * T + start + torch.arange(lengths[i]))
    spans = SequenceSpans.from_padding_mask(mask, [INDICES[i] for i in order])
    return Call((len(order), T), list(order), rows, spans, lengths=lengths)


def packed(row_lists: list[list[int]], extra: int, lengths=LENGTHS) -> Call:
    width = max(sum(lengths[i] for i in seqs) for seqs in row_lists) + extra
    segments = torch.full((len(row_lists), width), -1, dtype=torch.long)
    members, rows = [], []
    for r, seqs in enumerate(row_lists):
        col = 0
        for i in seqs:
            segments[r, col : col + lengths[i]] = len(members)
            rows.append(r * width + col + torch.arange(lengths[i]))
            members.append(i)
            col += lengths[i]
    spans = SequenceSpans.from_segments(segments, [INDICES[i] for i in members])
    return Call((len(row_lists), width), members, rows, spans, packed=True, lengths=lengths)


@cache
def layouts(lengths: tuple[int, ...] = LENGTHS) -> dict[str, list[Call]]:
    """The four layouts of five sequences of these lengths (the same orders, sides and padding
    for any lengths)."""
    return {
        "alone": [alone(i, lengths) for i in range(len(lengths))],
        "padded": [padded([4, 2, 0, 3, 1], [True, False, True, False, True], 3, lengths)],
        "two_micro_batches": [
            padded([1, 3], [False, True], 0, lengths),
            padded([0, 4, 2], [True] * 3, 10, lengths),
        ],
        "packed": [packed([[2, 0], [4, 1, 3]], 7, lengths)],
    }


LAYOUTS = layouts(LENGTHS)


def per_sequence(
    width: int, dtype, seed: int, scale: float = 1.0, lengths: tuple[int, ...] = LENGTHS
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, width, generator=g) * scale).to(dtype) for n in lengths]


def scatter(values: list[torch.Tensor], call: Call, fill: str) -> torch.Tensor:
    """(rows, cols, C): each member's values at its rows (its first ones, if the call holds
    fewer of its tokens); padding = garbage or zeros."""
    count, width = call.shape[0] * call.shape[1], values[0].shape[1]
    dtype = values[0].dtype
    if fill == "garbage":
        g = torch.Generator().manual_seed(99)
        out = (torch.randn(count, width, generator=g) * 1e4).to(dtype)
    else:
        out = torch.zeros(count, width, dtype=dtype)
    for i, rows in zip(call.members, call.rows):
        out[rows] = values[i][: rows.numel()]
    return out.view(*call.shape, width)


def gather(grad: torch.Tensor, call: Call) -> dict[int, torch.Tensor]:
    flat = grad.reshape(-1, grad.shape[-1])
    return {i: flat[rows] for i, rows in zip(call.members, call.rows)}


# ----------------------------------------------------------------------------- per-op runs
# run(call, dtype, params, sink, fill) -> {sequence: input gradient of its tokens} (or {})


def device_of(backend: str) -> str:
    """Where a backend's runs live: triton on cuda where there is one (else the interpreter)."""
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def random_params(
    shapes: dict, dtype, seed: int, device: str = "cpu"
) -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return {
        name: torch.nn.Parameter((torch.randn(*shape, generator=g) * 0.3).to(dtype).to(device))
        for name, shape in shapes.items()
    }


def run_projection(op_name):
    K, N = 96, 80

    def run(call, dtype, params, sink, fill, backend):
        dev = device_of(backend)
        x = scatter(call.values(K, dtype, 1), call, fill).to(dev).requires_grad_(True)
        out_dtype = dtype if op_name == "linear" else torch.float32
        dy = scatter(call.values(N, out_dtype, 2), call, fill).to(dev)
        kwargs = {} if sink is None else {"spans": call.spans, "sink": sink}
        get_op(op_name, dev, backend=backend)(
            x, params["weight"], params["bias"], **kwargs
        ).backward(dy)
        return gather(x.grad, call)

    return run, {"weight": (N, K), "bias": (N,)}


def run_logp(small_chunks: bool):
    H, V = 48, 300

    def run(call, dtype, params, sink, fill, backend):
        dev = device_of(backend)
        op = SMALL_CHUNK_LOGP if small_chunks else get_op("linear_logp", dev, backend=backend)
        h = scatter(call.values(H, dtype, 3), call, fill).to(dev).requires_grad_(True)
        g = torch.Generator().manual_seed(4)
        per_seq = []
        for n in call.lengths:
            t = torch.randint(0, V, (n,), generator=g)
            t[:3] = IGNORE  # the prompt: no target
            per_seq.append(t[:, None])
        targets = scatter(per_seq, call, "zeros")[..., 0].long()
        padding = torch.ones(targets.shape, dtype=torch.bool).view(-1)
        for rows in call.rows:
            padding[rows] = False
        targets.view(-1)[padding] = IGNORE
        coeff = scatter(call.values(1, torch.float32, 5), call, fill)[..., 0].to(dev)
        kwargs = {} if sink is None else {"spans": call.spans, "sink": sink}
        targets = targets.to(dev)
        op(h, params["weight"], targets, params["bias"], temperature=0.7, **kwargs).backward(coeff)
        return gather(h.grad, call)

    return run, {"weight": (V, H), "bias": (V,)}


# the shared chunked op with 8-row chunks: sequences of several blocks, chunks of several blocks
SMALL_CHUNK_LOGP = linear_logp_op(chunk_logprobs, lambda vocab: 8, GEMM, __name__, exact_gemm)


def run_embedding():
    V, H = 16, 40

    def run(call, dtype, params, sink, fill, backend):
        g = torch.Generator().manual_seed(6)
        ids = [torch.randint(0, V, (n, 1), generator=g) for n in call.lengths]  # many repeats
        flat_ids = scatter(ids, call, "zeros")[..., 0]
        if fill == "garbage":
            flat_ids = torch.where(flat_ids == 0, V - 1, flat_ids)  # padding: some id
            for i, rows in zip(call.members, call.rows):
                flat_ids.view(-1)[rows] = ids[i][: rows.numel(), 0]
        dev = device_of(backend)
        dy = scatter(call.values(H, dtype, 7), call, fill).to(dev)
        kwargs = {} if sink is None else {"spans": call.spans, "sink": sink}
        get_op("embedding", dev, backend=backend)(
            flat_ids.to(dev), params["weight"], 2, **kwargs
        ).backward(dy)
        return {}

    return run, {"weight": (V, H)}


def run_rms_norm():
    H = 96

    def run(call, dtype, params, sink, fill, backend):
        dev = device_of(backend)
        x = scatter(call.values(H, dtype, 8), call, fill).to(dev).requires_grad_(True)
        dy = scatter(call.values(H, dtype, 9), call, fill).to(dev)
        kwargs = {} if sink is None else {"spans": call.spans, "sink": sink}
        get_op("rms_norm", dev, backend=backend)(x, params["weight"], 1e-6, **kwargs).backward(dy)
        return gather(x.grad, call)

    return run, {"weight": (H,)}


def run_router():
    H, E = 40, 8

    def run(call, dtype, params, sink, fill, backend):
        """moe_router, top 3 renormalised: gradients through the weights and the logits."""
        dev = device_of(backend)
        x = scatter(call.values(H, dtype, 17), call, fill).to(dev).requires_grad_(True)
        kwargs = {} if sink is None else {"spans": call.spans, "sink": sink}
        router = get_op("moe_router", dev, backend=backend)
        logits, weights, _ = router(x, params["weight"], 3, renormalize=True, **kwargs)
        dw = scatter(call.values(3, dtype, 18), call, fill).reshape(weights.shape).to(dev)
        dl = scatter(call.values(E, dtype, 19), call, fill).reshape(logits.shape).to(dev)
        ((weights * dw).sum() + (logits * dl).sum()).backward()
        return gather(x.grad, call)

    return run, {"weight": (E, H)}


def run_experts():
    H, E, WIDTH, TOP = 24, 6, 10, 2  # WIDTH: the experts' intermediate size

    def run(call, dtype, params, sink, fill, backend):
        """moe_experts, top 2: input gradients of hidden and of the routing weights."""
        g = torch.Generator().manual_seed(20)
        first = [torch.randint(0, E, (n, 1), generator=g) for n in call.lengths]
        picks = [
            torch.cat([f, (f + 1 + torch.randint(0, E - 1, f.shape, generator=g)) % E], 1)
            for f in first
        ]
        dev = device_of(backend)
        indices = scatter(picks, call, "zeros").reshape(-1, TOP).to(dev)
        x = scatter(call.values(H, dtype, 21), call, fill).reshape(-1, H).to(dev)
        w = scatter(call.values(TOP, dtype, 22), call, fill).reshape(-1, TOP).to(dev)
        x, w = x.requires_grad_(True), w.requires_grad_(True)
        kwargs = {} if sink is None else {"spans": call.spans, "sink": sink}
        experts = get_op("moe_experts", dev, backend=backend)
        out = experts(x, params["gate_up"], params["down"], indices, w, **kwargs)
        out.backward(scatter(call.values(H, dtype, 23), call, fill).reshape(-1, H).to(dev))
        grads = torch.cat([x.grad, w.grad], 1)
        return gather(grads, call)

    return run, {"gate_up": (E, 2 * WIDTH, H), "down": (E, H, WIDTH)}


HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def run_attention(call, dtype, params, sink, fill, backend):
    """cpp attention (no parameters): padded calls with k_positions, packed ones with segments."""
    B, T = call.shape
    leaves = [
        scatter(call.values(h * HEAD_DIM, dtype, 11 + j), call, fill)
        .view(B, T, h, HEAD_DIM)
        .requires_grad_(True)
        for j, h in enumerate((HEADS, KV_HEADS, KV_HEADS))
    ]
    q, k, v = (t.transpose(1, 2) for t in leaves)
    dy = scatter(call.values(HEADS * HEAD_DIM, dtype, 14), call, fill)
    positions = call.positions()
    kwargs = {"q_positions": positions, "k_positions": positions}
    if call.packed:
        kwargs.update(q_segments=call.segments(), k_segments=call.segments())
    out = get_op("attention", "cpu", backend=backend)(q, k, v, **kwargs)
    out.backward(dy.view(B, T, HEADS, HEAD_DIM).transpose(1, 2))
    grads = [gather(t.grad.reshape(B, T, -1), call) for t in leaves]
    return {i: torch.cat([g[i] for g in grads], 1) for i in grads[0]}


def run_silu(call, dtype, params, sink, fill, backend):
    x = scatter(call.values(77, dtype, 15, scale=4.0), call, fill).requires_grad_(True)
    get_op("silu", "cpu", backend=backend)(x).backward(
        scatter(call.values(77, dtype, 16), call, fill)
    )
    return gather(x.grad, call)


OPS = {
    "linear": run_projection("linear"),
    "lm_head": run_projection("lm_head"),
    "linear_logp": run_logp(small_chunks=False),
    "linear_logp_8_row_chunks": run_logp(small_chunks=True),  # cpp's chunk, 8 rows
    "embedding": run_embedding(),
    "rms_norm": run_rms_norm(),
    "moe_router": run_router(),
    "moe_experts": run_experts(),
    "attention": (run_attention, {}),
    "silu": (run_silu, {}),
}


def run_layout(
    op: str, layout: str, dtype, *, sink: bool, fill: str, backend: str = "cpp", lengths=LENGTHS
):
    """(sink records merged over the layout's calls, input grads by sequence, plain .grads)."""
    run, shapes = OPS[op]
    params = random_params(shapes, dtype, 10, device_of(backend))
    records, grads = {}, {}
    for call in layouts(lengths)[layout]:
        recorder = RecordingSink() if sink else None
        grads.update(run(call, dtype, params, recorder, fill, backend))
        if sink:
            assert not set(records) & set(recorder.records)
            records.update(recorder.records)
    plain = {name: p.grad for name, p in params.items()}
    return records, grads, plain


def same_partial(a, b) -> bool:
    if isinstance(a, tuple):
        return all(torch.equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


# parameter -> the role its partials carry
ROLES = {
    "linear": {"weight": "linear", "bias": "bias"},
    "lm_head": {"weight": "lm_head", "bias": "bias"},
    "linear_logp": {"weight": "lm_head", "bias": "bias"},
    "linear_logp_8_row_chunks": {"weight": "lm_head", "bias": "bias"},
    "embedding": {"weight": "embedding"},
    "rms_norm": {"weight": "rms_norm"},
    "moe_router": {"weight": "moe_router"},
    "moe_experts": {"gate_up": "moe_gate_up", "down": "moe_down"},
}


def check_a_sequence_without_rows_reports_zeros(op: str, backend: str) -> None:
    """An all-padding batch row (a dummy sequence) is reported, with +0 partials / no rows."""
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])  # sequence 1's first two tokens; 3: none
    spans = SequenceSpans.from_padding_mask(mask, [INDICES[1], INDICES[3]])
    call = Call((2, 3), [1, 3], [torch.arange(2), torch.zeros(0, dtype=torch.long)], spans)
    run, shapes = OPS[op]
    sink = RecordingSink()
    params = random_params(shapes, torch.float32, 10, device_of(backend))
    run(call, torch.float32, params, sink, "garbage", backend)
    for (_, index), value in sink.records.items():
        if index != INDICES[3]:
            continue
        if isinstance(value, tuple):
            assert value[0].numel() == 0 and value[1].shape[0] == 0
        else:
            assert torch.equal(value, torch.zeros_like(value))
            assert not torch.signbit(value).any()  # +0, not -0
    assert {index for _, index in sink.records} == {INDICES[1], INDICES[3]}
