"""`RolloutEngine`: continuous-batching KV-cache generation with per-token logprobs.

The engine keeps a queue of requests (prompt x sample index) and at most
`max_batch_size` running sequences, each in a slot of a `SlotKVCache`. Every
iteration it prefills newly admitted prompts into free slots (one forward:
right-padded, or, patched and with prompts of different lengths, packed into one
row with segment-aware attention) and then decodes one token for every running
sequence (one forward, one query each). A sequence that samples EOS / a stop token or
reaches `max_new_tokens` frees its slot at once, so batch composition and
cache lengths change from step to step.

Logprobs. With a patched model (`rl_engine.patching.apply_batch_invariant`)
the last hidden state of each sequence goes through the `lm_head` and
`log_softmax(logits, T)` ops the model was patched with (`model_op`): the
definition that the same backend's `linear_logp` implements, so every recorded
logprob equals the trainer's teacher-forced recompute bit for bit (see rl_engine/rollout/sampling.py for
what the number means under top-k / top-p). The decoder runs as
`model.base_model(..., use_cache=False, rl_kv_cache=cache)`: transformers
forwards the unknown kwarg to the attention function, where the hook of
`rl_engine.patching.attention` reads and writes the cache.

Invariance off. An unpatched model runs the same loop with the plain
cache-aware SDPA attention (`PLAIN_CACHED_NAME`, switched in for the duration
of `generate`) and its own lm_head + `torch.log_softmax`: fast-path numerics,
for benchmarks and mismatch diagnostics.
"""

from __future__ import annotations

import heapq
import logging
import sys
import time
from collections import deque
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from rl_engine.devices import check_device
from rl_engine.patching import (
    KV_CACHE_KWARG,
    PACKED_KWARG,
    PackedSegments,
    is_patched,
    lm_head_parameters,
    model_op,
    patch_handle,
)
from rl_engine.patching.attention import PLAIN_CACHED_NAME, register_plain_cached_attention
from rl_engine.rollout.kv_cache import SlotKVCache
from rl_engine.rollout.sampling import SamplingParams, request_generator, sample_token
from rl_engine.rollout.weight_plan import WeightManifest, WeightPlan
from rl_engine.rollout.weight_receiver import WeightReceiver
from rl_engine.rollout.weights import copy_weights, plan_weight_copy

logger = logging.getLogger(__name__)

PAD_ID = 0  # fills the right padding of a ragged prefill; never attended to, never scored
# A patched engine packs a prefill into one row when the padded batch would compute more
# than this many times its real tokens (measured: docs/benchmarks.md, "Rollout prefill").
PACK_PREFILL = 1.25


@dataclass
class Completion:
    """One sampled completion; `logprobs[i]` is the fp32 logprob of `token_ids[i]`.

    A logprob is log_softmax(logits / logprob_temperature) over the full vocabulary (never
    renormalised by top-k / top-p); `weight_version` is the engine's weights' version.
    """

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: torch.Tensor  # (len(token_ids),) fp32
    finish_reason: str  # "stop" (EOS / stop token, included in token_ids) | "length"
    weight_version: int | None  # None: read from a rollout file that did not say
    prompt_index: int
    sample_index: int
    logprob_temperature: float = 1.0
    reward: float | None = None  # set by the job before saving, or read from a rollout file


@dataclass
class GenerateStats:
    """What the last `generate` call did (for tests, logging and benchmarks)."""

    slots: int = 0
    prefill_forwards: int = 0
    packed_prefills: int = 0  # prefill forwards that ran packed (see _Stepper.prefill)
    decode_forwards: int = 0
    admitted_while_running: int = 0  # sequences prefilled into a slot freed mid-run
    batch_sizes: list[int] = field(
        default_factory=list
    )  # running sequences of every decode forward
    seconds: float = 0.0


@dataclass
class _Sequence:
    """A request while it is generated."""

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    generator: torch.Generator
    slot: int = -1
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int, logprob: float, sampling: SamplingParams) -> None:
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        if sampling.stops_on(token):
            self.finish_reason = "stop"
        elif len(self.token_ids) >= sampling.max_new_tokens:
            self.finish_reason = "length"

    def completion(self, weight_version: int, logprob_temperature: float) -> Completion:
        return Completion(
            prompt_ids=list(self.prompt_ids),
            token_ids=list(self.token_ids),
            logprobs=torch.tensor(
                self.logprobs, dtype=torch.float32
            ),  # fp32 -> float -> fp32 is exact
            finish_reason=self.finish_reason,
            weight_version=weight_version,
            prompt_index=self.prompt_index,
            sample_index=self.sample_index,
            logprob_temperature=logprob_temperature,
        )


class RolloutEngine:
    """Generates completions of a Hugging Face causal LM and records every token's logprob.

    model: a transformers causal LM already on `device`; patched with
    `apply_batch_invariant` for bitwise parity with the trainer, or unpatched
    (invariance off). device: where every op is looked up and every input is
    built. max_batch_size: most sequences decoded at once. max_seq_len: most
    positions of prompt + completion (default: the model's
    max_position_embeddings). progress: tqdm bar; None = only on a TTY.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        device: str | torch.device,
        max_batch_size: int = 8,
        max_seq_len: int | None = None,
        weight_version: int = 0,
        progress: bool | None = None,
    ):
        self.device = check_device(device)
        _check_model(model, self.device)
        if not _is_int(max_batch_size) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
        self.model = model
        self.max_batch_size = max_batch_size
        self.max_seq_len = _resolve_max_seq_len(model, max_seq_len)
        self.weight_version = _check_version(weight_version)
        self.progress = progress
        self.vocab_size = model.get_input_embeddings().weight.shape[0]
        self.last_stats = GenerateStats()
        self._torn: str | None = None  # why the weights are incomplete (a failed sync), if they are

    @property
    def batch_invariant(self) -> bool:
        """True when the model is patched: logprobs then match the trainer bit for bit."""
        return is_patched(self.model)

    # ------------------------------------------------------------------ public API

    def generate(
        self,
        prompts: Sequence[Sequence[int] | torch.Tensor],
        sampling: SamplingParams | None = None,
        *,
        progress: bool | None = None,
    ) -> list[Completion]:
        """Sample `sampling.n` completions per prompt; returned prompt-major, then by sample index."""
        if self._torn is not None:
            raise RuntimeError(
                f"the engine's weights are incomplete: {self._torn}; receive a complete "
                "version (or load_weights) before generating"
            )
        sampling = SamplingParams() if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        prompt_ids = self._check_prompts(prompts, sampling)
        self.last_stats = GenerateStats()
        if not prompt_ids:
            return []
        seqs = [
            _Sequence(p, s, ids, request_generator(sampling.seed, p, s))
            for p, ids in enumerate(prompt_ids)
            for s in range(sampling.n)
        ]
        start = time.perf_counter()
        with (
            torch.inference_mode(),
            self._attention_mode(),
            self._progress_bar(len(seqs), progress) as bar,
        ):
            self._run(seqs, sampling, bar)
        self.last_stats.seconds = time.perf_counter() - start
        self._log_summary(seqs, self.last_stats.seconds)
        return [seq.completion(self.weight_version, sampling.logprob_temperature) for seq in seqs]

    def load_weights(self, state_dict, version: int) -> None:
        """Copy `state_dict` into the model in place and set `weight_version`; validates everything first."""
        version = _check_version(version)
        plan = plan_weight_copy(self.model, state_dict)
        copy_weights(plan)
        self.weight_version, self._torn = version, None
        logger.info("loaded %d tensors, weight_version=%d", len(plan), version)

    def weight_receiver(
        self,
        manifest: WeightManifest,
        plan: WeightPlan | None = None,
        *,
        receiver: int = 0,
        bucket_bytes: int,
    ) -> WeightReceiver:
        """A receiver of weight syncs into this engine's own parameters (`plan`: everything by
        default); raises ValueError naming the key when the manifest does not fit the model."""
        plan = WeightPlan.everything(manifest) if plan is None else plan
        targets = self.model.state_dict(keep_vars=True)
        return WeightReceiver(targets, manifest, plan, receiver, bucket_bytes)

    def receive_weights(self, receiver: WeightReceiver, channel, *, on_bucket=None) -> int:
        """One weight sync into the parameters in place; `weight_version` becomes its version
        once every piece has landed. A sync that fails part way leaves the weights torn and
        `generate` refuses to run until a complete sync (or `load_weights`)."""

        def torn(version: int) -> None:
            self._torn = f"the weight sync to version {version} did not complete"

        version = receiver.receive(channel, on_bucket=on_bucket, on_header=torn)
        self.weight_version, self._torn = _check_version(version), None
        return version

    # ------------------------------------------------------------------ scheduling

    def _run(self, seqs: list[_Sequence], sampling: SamplingParams, bar) -> None:
        """Continuous batching: admit into free slots, prefill them, decode every running sequence."""
        capacity = max(len(s.prompt_ids) for s in seqs) + sampling.max_new_tokens
        num_slots = min(self.max_batch_size, len(seqs))
        cache = self._make_cache(num_slots, capacity)
        step = self._make_stepper(cache, sampling)
        waiting, running, free = deque(seqs), [], list(range(num_slots))
        stats = self.last_stats
        stats.slots = num_slots
        while waiting or running:
            admitted = _admit(waiting, free)
            if admitted:
                stats.packed_prefills += step.prefill(admitted)
                stats.prefill_forwards += 1
                stats.admitted_while_running += len(admitted) if running else 0
            active = running + admitted
            running = [s for s in active if not s.finished]
            if running:
                step.decode(running)
                stats.decode_forwards += 1
                stats.batch_sizes.append(len(running))
            for seq in active:
                if seq.finished:
                    _release(seq, free)
                    bar.update(1)
            running = [s for s in running if not s.finished]

    # ------------------------------------------------------------------ helpers

    def _make_stepper(self, cache: SlotKVCache, sampling: SamplingParams) -> _Stepper:
        """The forwards of one generate call (the tensor-parallel engine shards them)."""
        return _Stepper(self, cache, sampling)

    def _make_cache(self, num_slots: int, capacity: int) -> SlotKVCache:
        """Invariant: the layout the backend's attention reads in place (its key block, and
        the compute dtype when the backend asks for it)."""
        handle = patch_handle(self.model)
        if handle is None:
            return SlotKVCache(num_slots, capacity, self.device)
        dtype = None
        if handle.layout.kv_in_compute_dtype:
            wide = next(self.model.parameters()).dtype == torch.float64
            dtype = torch.float64 if wide else torch.float32  # the op's compute dtype
        block = handle.layout.kv_block
        return SlotKVCache(num_slots, capacity, self.device, dtype=dtype, block=block)

    @contextmanager
    def _attention_mode(self):
        """Patched: the invariant hook is already set. Unpatched: plain cached SDPA for this call."""
        config = self.model.config
        handle = patch_handle(self.model)
        if handle is not None:
            if config._attn_implementation != handle.attention_name:
                raise RuntimeError(
                    f"model is patched but uses attention {config._attn_implementation!r}, "
                    f"not {handle.attention_name!r}"
                )
            yield
            return
        register_plain_cached_attention()
        before = config._attn_implementation
        self.model.set_attn_implementation(PLAIN_CACHED_NAME)
        try:
            yield
        finally:
            self.model.set_attn_implementation(before)

    def _progress_bar(self, total: int, progress: bool | None):
        from tqdm import tqdm

        enabled = self.progress if progress is None else progress
        if enabled is None:
            enabled = sys.stderr.isatty()
        return tqdm(total=total, desc="rollout", unit="seq", disable=not enabled, leave=False)

    def _check_prompts(self, prompts, sampling: SamplingParams) -> list[list[int]]:
        if isinstance(prompts, torch.Tensor) or not isinstance(prompts, Sequence):
            raise ValueError(
                f"prompts must be a list of token-id lists or 1-D tensors, got {type(prompts).__name__}"
            )
        return [self._check_prompt(i, p, sampling) for i, p in enumerate(prompts)]

    def _check_prompt(self, index: int, prompt, sampling: SamplingParams) -> list[int]:
        ids = _as_id_list(index, prompt)
        if not ids:
            raise ValueError(f"prompt {index} is empty")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"prompt {index} has token id {bad} outside the vocabulary [0, {self.vocab_size})"
            )
        total = len(ids) + sampling.max_new_tokens
        if total > self.max_seq_len:
            raise ValueError(
                f"prompt {index}: {len(ids)} prompt tokens + max_new_tokens {sampling.max_new_tokens} "
                f"= {total} > max_seq_len {self.max_seq_len}"
            )
        return ids

    def _log_summary(self, seqs: list[_Sequence], seconds: float) -> None:
        tokens = sum(len(s.token_ids) for s in seqs)
        logger.info(
            "generated %d completions, %d tokens in %.2f s (%.1f tokens/s), batch_invariant=%s, weight_version=%d",
            len(seqs),
            tokens,
            seconds,
            tokens / max(seconds, 1e-9),
            self.batch_invariant,
            self.weight_version,
        )


class _Stepper:
    """One generate call's forwards: prefill / decode a batch of sequences, score, sample."""

    def __init__(self, engine: RolloutEngine, cache: SlotKVCache, sampling: SamplingParams):
        self.engine, self.model, self.cache, self.sampling = engine, engine.model, cache, sampling
        self.device = engine.device
        self.temperature = sampling.logprob_temperature
        if engine.batch_invariant:
            self._lm_head = model_op(self.model, "lm_head")
            self._log_softmax = model_op(self.model, "log_softmax")
            self._head_params = lm_head_parameters(self.model)

    def prefill(self, seqs: list[_Sequence]) -> bool:
        """Run the prompts of newly admitted sequences and sample their first token: packed
        into one row (`_packed_prefill`) when that computes much less padding, else
        right-padded. Returns whether it ran packed."""
        seqs = sorted(seqs, key=lambda s: s.slot)
        lengths = [len(s.prompt_ids) for s in seqs]
        if self.engine.batch_invariant and len(seqs) * max(lengths) > PACK_PREFILL * sum(lengths):
            self._packed_prefill(seqs)
            return True
        longest = max(len(s.prompt_ids) for s in seqs)
        ids = torch.full((len(seqs), longest), PAD_ID, dtype=torch.long)  # (B, T)
        positions = torch.full((len(seqs), longest), -1, dtype=torch.long)  # (B, T), -1 = padding
        for row, seq in enumerate(seqs):
            n = len(seq.prompt_ids)
            ids[row, :n] = torch.tensor(seq.prompt_ids)
            positions[row, :n] = torch.arange(n)
        last = torch.tensor([len(s.prompt_ids) - 1 for s in seqs])  # (B,)
        self._step(seqs, ids, positions, last)
        return False

    def _packed_prefill(self, seqs: list[_Sequence]) -> None:
        """The prompts concatenated in one row (positions restarting at 0): segment-aware
        attention on the row's own keys, which the cache stores for decoding (`bind_packed`).
        Every token gets the bits of the padded prefill (the invariant ops are row-wise)."""
        lengths = [len(s.prompt_ids) for s in seqs]
        ids = torch.tensor([[t for s in seqs for t in s.prompt_ids]], device=self.device)  # (1, N)
        positions = torch.cat([torch.arange(n) for n in lengths])[None].to(self.device)
        segments = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
        token_slots = torch.cat([torch.full((n,), s.slot) for s, n in zip(seqs, lengths)])[None]
        last = torch.tensor(lengths).cumsum(0) - 1  # (B,) column of each prompt's last token
        self.cache.bind_packed(token_slots.to(self.device), positions)
        try:
            out = self.model.base_model(
                input_ids=ids,
                position_ids=positions,
                use_cache=False,
                **{
                    KV_CACHE_KWARG: self.cache,
                    PACKED_KWARG: PackedSegments(positions, segments.to(self.device)),
                },
            )
        finally:
            self.cache.unbind()
        hidden = out.last_hidden_state[0, last.to(self.device)]  # (B, H)
        self._sample(seqs, self._logprobs(hidden))

    def decode(self, seqs: list[_Sequence]) -> None:
        """Feed every sequence's last sampled token (one query each) and sample the next."""
        seqs = sorted(seqs, key=lambda s: s.slot)
        ids = torch.tensor([[s.token_ids[-1]] for s in seqs])  # (B, 1)
        positions = torch.tensor([[s.length - 1] for s in seqs])  # (B, 1)
        self._step(seqs, ids, positions, torch.zeros(len(seqs), dtype=torch.long))

    def _step(self, seqs, ids, positions, last) -> None:
        slots = torch.tensor([s.slot for s in seqs], device=self.device)
        hidden = self._last_hidden(
            ids.to(self.device), positions.to(self.device), last.to(self.device), slots
        )
        logp = self._logprobs(hidden)  # (B, V) fp32
        self._sample(seqs, logp)

    def _last_hidden(self, ids, positions, last, slots) -> torch.Tensor:
        """(B, H) final-norm hidden state of each row's token at column `last`."""
        self.cache.bind(slots, positions)
        try:
            out = self.model.base_model(
                input_ids=ids,
                position_ids=positions.clamp(min=0),
                use_cache=False,
                **{KV_CACHE_KWARG: self.cache},
            )
        finally:
            self.cache.unbind()
        rows = torch.arange(ids.shape[0], device=ids.device)
        return out.last_hidden_state[rows, last]  # (B, H)

    def _logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, H) -> (B, V) fp32 log softmax(logits / T) over the full vocabulary."""
        if self.engine.batch_invariant:
            weight, bias = self._head_params
            return self._log_softmax(self._lm_head(hidden, weight, bias), self.temperature)
        logits = self.model.get_output_embeddings()(hidden).float()  # (B, V)
        if self.temperature != 1.0:
            logits = logits / self.temperature
        return torch.log_softmax(logits, dim=-1)

    def _sample(self, seqs: list[_Sequence], logp: torch.Tensor) -> None:
        tokens, picked = self._choose(seqs, logp)
        for seq, token, value in zip(seqs, tokens, picked):
            seq.append(token, value, self.sampling)

    def _choose(self, seqs: list[_Sequence], logp: torch.Tensor) -> tuple[list[int], list[float]]:
        """Each row's sampled token and its logprob (row r of logp is seqs[r])."""
        logp_cpu = logp.cpu()
        tokens = [
            sample_token(logp_cpu[row], self.sampling, seq.generator)
            for row, seq in enumerate(seqs)
        ]
        rows = torch.arange(len(seqs))
        return tokens, logp_cpu[rows, torch.tensor(tokens)].tolist()


def _admit(waiting: deque, free: list[int]) -> list[_Sequence]:
    """Move waiting sequences into the lowest free slots (lowest first keeps batches contiguous)."""
    admitted = []
    while waiting and free:
        seq = waiting.popleft()
        seq.slot = heapq.heappop(free)
        admitted.append(seq)
    if admitted:
        logger.debug(
            "admitted %d sequences into slots %s", len(admitted), [s.slot for s in admitted]
        )
    return admitted


def _release(seq: _Sequence, free: list[int]) -> None:
    heapq.heappush(free, seq.slot)
    seq.slot = -1


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_id_list(index: int, prompt) -> list[int]:
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype == torch.bool:
            raise ValueError(
                f"prompt {index} must be a 1-D integer tensor, got shape {tuple(prompt.shape)} dtype {prompt.dtype}"
            )
        return prompt.tolist()
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
        raise ValueError(
            f"prompt {index} must be a list of token ids or a 1-D tensor, got {type(prompt).__name__}"
        )
    bad = next((t for t in prompt if not _is_int(t)), None)
    if bad is not None:
        raise ValueError(f"prompt {index} has a non-integer token id {bad!r}")
    return list(prompt)


def _check_model(model, device: torch.device) -> None:
    if not isinstance(model, nn.Module) or getattr(model, "config", None) is None:
        raise ValueError(f"model must be a Hugging Face causal LM, got {type(model).__name__}")
    param = next(model.parameters(), None)
    if param is None:
        raise ValueError("model has no parameters")
    same = param.device.type == device.type and (
        device.index is None or param.device.index == device.index
    )
    if not same:
        raise ValueError(
            f"model is on {param.device}, but the engine's device is {device}; move the model first"
        )


def _resolve_max_seq_len(model, max_seq_len) -> int:
    if max_seq_len is None:
        max_seq_len = getattr(model.config, "max_position_embeddings", None)
        if max_seq_len is None:
            raise ValueError(
                "max_seq_len is None and the model config has no max_position_embeddings; pass it"
            )
    if not _is_int(max_seq_len) or max_seq_len < 2:
        raise ValueError(f"max_seq_len must be an int >= 2, got {max_seq_len!r}")
    return max_seq_len


def _check_version(version) -> int:
    if not _is_int(version):
        raise ValueError(f"version must be an int, got {version!r}")
    return version
