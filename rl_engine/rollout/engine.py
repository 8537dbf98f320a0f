"""`RolloutEngine`: continuous-batching KV-cache generation with per-token logprobs.

`generate` turns every (prompt, sample index) into a `Request` (completion.py) and
runs them to their end by continuous batching (scheduler.py): at most
`max_batch_size` requests in the slots of a `SlotKVCache`, prefilled when admitted
(right-padded, or, patched and with prompts of different lengths, packed into one
row with segment-aware attention) and decoded one token per forward; a finished
request frees its slot at once. `generate_episodes` plays multi-turn episodes in the same
loop: a request that ends a model turn asks the caller's hook for the next, which keeps its
slot and prefills [its last sampled token, the observation] at the slot's length beside the
other sequences' decodes (turns.py). The forwards, the scoring and the draw of each
token are the stepper's (stepper.py). With `share_prompt_prefill` (the default) the
samples of one prompt share one prefill: it runs once and the other slots copy its KV
rows (prompt_sharing.py); with a patched model the bits are those of a prefill per sample.

Logprobs. With a patched model (`rl_engine.patching.apply_batch_invariant`) every
recorded logprob equals the trainer's teacher-forced recompute bit for bit (see
rl_engine/rollout/sampling.py for what the number means under top-k / top-p). The
decoder runs as `model.base_model(..., use_cache=False, rl_kv_cache=cache)`:
transformers forwards the unknown kwarg to the attention function, where the hook
of `rl_engine.patching.attention` reads and writes the cache.

Invariance off. An unpatched model runs the same loop with the plain
cache-aware SDPA attention (`PLAIN_CACHED_NAME`, switched in for the duration
of `generate`) and its own lm_head + `torch.log_softmax`: fast-path numerics,
for benchmarks and mismatch diagnostics.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Sequence
from contextlib import contextmanager

import torch
from torch import nn

from rl_engine.base.fields import check_bool, is_int
from rl_engine.kernels.devices import check_device
from rl_engine.patching import is_patched, patch_handle
from rl_engine.patching.attention import PLAIN_CACHED_NAME, register_plain_cached_attention
from rl_engine.patching.packed_weights import PackedWeights
from rl_engine.rollout.checks import (
    check_budgets,
    check_max_batch_size,
    check_model,
    check_prompts,
    check_sampling,
    check_version,
    resolve_max_seq_len,
)
from rl_engine.rollout.completion import Completion, Request
from rl_engine.rollout.kv_cache import SlotKVCache
from rl_engine.rollout.sampling import SamplingParams, request_key
from rl_engine.rollout.scheduler import GenerateStats, run_continuous_batching
from rl_engine.rollout.speculative import (
    SpeculationCounts,
    SpeculativeParams,
    attach_speculation,
    check_speculation,
)
from rl_engine.rollout.stepper import Stepper
from rl_engine.rollout.turns import OnTurnEnd, TurnChain, TurnStart, check_starts
from rl_engine.rollout.weight_plan import WeightManifest, WeightPlan
from rl_engine.rollout.weight_receiver import WeightReceiver, WeightReleaseError
from rl_engine.rollout.weights import copy_weights, plan_weight_copy

logger = logging.getLogger(__name__)


class RolloutEngine:
    """Generates completions of a Hugging Face causal LM and records every token's logprob.

    model: a transformers causal LM already on `device`; patched with
    `apply_batch_invariant` for bitwise parity with the trainer, or unpatched
    (invariance off). device: where every op is looked up and every input is
    built. max_batch_size: most sequences decoded at once. max_seq_len: most
    positions of prompt + completion (default: the model's
    max_position_embeddings). progress: tqdm bar; None = only on a TTY.
    share_prompt_prefill: run each distinct prompt through the model once per call and
    copy its KV rows into the other samples' slots (prompt_sharing.py); False: one
    prefill per sample.
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
        share_prompt_prefill: bool = True,
        speculative: SpeculativeParams | None = None,
        draft_model: nn.Module | None = None,
    ):
        self.device = check_device(device)
        check_model(model, self.device)
        self.model = model
        self.max_batch_size = check_max_batch_size(max_batch_size)
        check_bool("share_prompt_prefill", share_prompt_prefill)
        self.share_prompt_prefill = share_prompt_prefill
        self.max_seq_len = resolve_max_seq_len(model, max_seq_len)
        self.weight_version = check_version(weight_version)
        self.progress = progress
        check_speculation(speculative, model, draft_model, self.device)
        self.speculative, self.draft_model = speculative, draft_model
        # every call's counts added up (a job reads and resets it once a step)
        self.speculation_total = None if speculative is None else SpeculationCounts()
        self.vocab_size = model.get_input_embeddings().weight.shape[0]
        self.last_stats = GenerateStats()
        self._torn: str | None = None  # why the weights are incomplete (a failed sync), if they are
        # the fast path's GEMM weights (the policy's and a draft's), repacked at the start of
        # every call into buffers kept between calls (packed_weights.py)
        self.packed_weights = PackedWeights()

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
        after_env_turn: bool = False,
        budgets: Sequence[int] | None = None,
    ) -> list[Completion]:
        """Sample `sampling.n` completions per prompt; returned prompt-major, then by sample index.

        after_env_turn: the prompts continue transcripts after an environment turn
        (multi-turn); their prefills never share (a group's transcripts diverge), whatever
        `share_prompt_prefill` says. budgets: each prompt's own most sampled tokens (at most
        `sampling.max_new_tokens`; None: that for every prompt)."""
        self._check_weights_complete()
        check_bool("after_env_turn", after_env_turn)
        sampling = check_sampling(sampling)
        prompt_ids = check_prompts(
            prompts,
            vocab_size=self.vocab_size,
            max_seq_len=self.max_seq_len,
            max_new_tokens=sampling.max_new_tokens,
        )
        self.last_stats = GenerateStats()
        if not prompt_ids:
            return []
        budgets = check_budgets(budgets, len(prompt_ids), sampling.max_new_tokens)
        requests = [
            Request(
                p,
                s,
                ids,
                request_key(sampling.seed, p, s),
                shares_prefill=not after_env_turn,
                max_new_tokens=budgets[p],
            )
            for p, ids in enumerate(prompt_ids)
            for s in range(sampling.n)
        ]
        capacity = max(len(ids) for ids in prompt_ids) + sampling.max_new_tokens  # per slot
        self._run(requests, capacity, sampling, progress)
        self._log_summary(requests, self.last_stats.seconds)
        return [r.completion(self.weight_version, sampling.logprob_temperature) for r in requests]

    def generate_episodes(
        self,
        starts: Sequence[TurnStart],
        sampling: SamplingParams,
        on_turn_end: OnTurnEnd | None = None,
        *,
        max_total_tokens: int,
        progress: bool | None = None,
    ) -> list[Completion]:
        """Multi-turn episodes by continuous batching (turns.py): each `TurnStart` samples a
        turn (sampling.n must be 1) of at most `turn_budget` tokens; when it ends,
        `on_turn_end(index, turn)` answers with a `Continuation`, which the episode plays in
        its own slot at the next iteration (a prefill at the slot's length, beside the other
        sequences' decodes), or None. Each turn draws with the key of (sampling.seed, episode,
        turn) (`turn_key`). Every slot holds `max_total_tokens` positions. Returns each episode's
        last turn, in the order of `starts`; `last_stats` counts the continuations."""
        self._check_weights_complete()
        sampling = check_sampling(sampling)
        if sampling.n != 1:
            raise ValueError(f"generate_episodes plays one episode per start, got n={sampling.n}")
        if not is_int(max_total_tokens) or not 2 <= max_total_tokens <= self.max_seq_len:
            raise ValueError(
                f"max_total_tokens must be an int in [2, max_seq_len = {self.max_seq_len}], "
                f"got {max_total_tokens!r}"
            )
        episodes = check_starts(starts)
        prompt_ids = check_prompts(
            [s.prompt_ids for s in starts],
            vocab_size=self.vocab_size,
            max_seq_len=max_total_tokens,
            max_new_tokens=1,
        )
        self.last_stats = GenerateStats()
        if not prompt_ids:
            return []
        chain = TurnChain(
            episodes,
            prompt_ids,
            sampling,
            on_turn_end,
            max_total_tokens=max_total_tokens,
            vocab_size=self.vocab_size,
            weight_version=self.weight_version,
        )
        requests = chain.first_requests()
        self._run(requests, max_total_tokens, sampling, progress, chain.next_turn)
        self._log_summary(chain.requests, self.last_stats.seconds)
        return chain.last_turns()

    def load_weights(self, state_dict, version: int) -> None:
        """Copy `state_dict` into the model in place and set `weight_version`; validates everything first."""
        version = check_version(version)
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
        self.weight_version, self._torn = check_version(version), None
        return version

    def release_weights(self, receiver: WeightReceiver) -> int:
        """Hand the memory of every weight `receiver`'s syncs write back to the OS until the
        next complete sync refills it (a full-weight run's engine between its generate and
        the sync after the trainer's step, when the ranks hold their peak), and free the
        packed copies of the GEMM weights (`release_packed_weights`); `generate` refuses to
        run until then. Returns the bytes released; WeightReleaseError (nothing released,
        the weights still served) when a sync would not rewrite one whole."""
        previous = self._torn
        self._torn = "they were released until the next weight sync (release_weights)"
        try:
            released = receiver.release_targets()
        except WeightReleaseError:
            self._torn = previous  # checked before any release
            raise
        return released + self.release_packed_weights()

    def release_packed_weights(self) -> int:
        """Free the packed copies of the GEMM weights that the engine keeps between calls
        (about the model's size again; packed_weights.py); the next call packs into new
        buffers. Returns the bytes freed."""
        held = self.packed_weights.nbytes
        self.packed_weights.release()
        return held

    # ------------------------------------------------------------------ helpers

    def _run(self, requests: list[Request], capacity: int, sampling, progress, next_turn=None):
        """Every request to its end by continuous batching in slots of `capacity` positions."""
        num_slots = min(self.max_batch_size, len(requests))
        start = time.perf_counter()
        with (
            torch.inference_mode(),
            self._attention_mode(),
            self._progress_bar(len(requests), progress) as bar,
        ):
            step = self._make_stepper(self._make_cache(num_slots, capacity), sampling)
            if self.speculative is not None:
                cache = functools.partial(self._make_cache, num_slots, capacity)
                attach_speculation(self, step, cache, sampling)
            run_continuous_batching(requests, step, num_slots, self.last_stats, bar, next_turn)
            if step.speculation is not None:
                self.last_stats.speculation = step.speculation.counts
                self.speculation_total.add(step.speculation.counts)
        self.last_stats.seconds = time.perf_counter() - start

    def _check_weights_complete(self) -> None:
        if self._torn is not None:
            raise RuntimeError(
                f"the engine's weights are incomplete: {self._torn}; receive a complete "
                "version (or load_weights) before generating"
            )

    def _make_stepper(self, cache: SlotKVCache, sampling: SamplingParams) -> Stepper:
        """The forwards of one generate call (the tensor-parallel engine shards them)."""
        return Stepper(self, cache, sampling)

    def _make_cache(self, num_slots: int, capacity: int, model=None) -> SlotKVCache:
        """Invariant: the layout the backend's attention reads in place (its key block, and
        the compute dtype when the backend asks for it). model: whose cache (the policy's;
        a speculating engine's draft model has its own)."""
        model = self.model if model is None else model
        handle = patch_handle(model)
        if handle is None:
            return SlotKVCache(num_slots, capacity, self.device)
        dtype = None
        if handle.layout.kv_in_compute_dtype:
            wide = next(model.parameters()).dtype == torch.float64
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

    def _log_summary(self, requests: list[Request], seconds: float) -> None:
        tokens = sum(len(r.token_ids) for r in requests)
        logger.info(
            "generated %d completions, %d tokens in %.2f s (%.1f tokens/s), batch_invariant=%s, weight_version=%d",
            len(requests),
            tokens,
            seconds,
            tokens / max(seconds, 1e-9),
            self.batch_invariant,
            self.weight_version,
        )
