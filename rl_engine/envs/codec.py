"""Between an episode's token ids and its environment's text: `TurnCodec`.

- a model turn's text (`text`: decoded without special tokens, as verl decodes a solution;
  None without a tokenizer);
- where a turn ends at a stop string (`stop_cut`): the engine stops only on token ids, so a
  turn is sampled to EOS or max_new_tokens and then cut after the token that completes the
  first stop string. The tokens kept are a prefix of what was sampled, so their logprobs are
  unchanged (the tokens after the cut are dropped, never trained on);
- an observation's ids (`observation_ids`): token ids as given, or text through the chat
  template as a `tool` message closed by the assistant's generation prompt (the template's
  rendering of [user, assistant, tool] minus that of [user, assistant]); a tokenizer without a
  chat template encodes the text as it is;
- a prompt `reset` returned (`prompt_ids`): ids, text (one user turn) or chat messages.

Every problem with what an environment returned raises `ObservationError` (a ValueError),
which the episode counts as an environment error; a chat template that cannot render a tool
message is the run's problem, not the episode's: a plain ValueError, which stops the job.
"""

from __future__ import annotations

from collections.abc import Sequence

from rl_engine.data import encode_messages
from rl_engine.envs.protocol import is_token_list

# the chat that a tool message is rendered after: its rendering is cut off again
_BEFORE_TOOL = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "."}]


class ObservationError(ValueError):
    """An observation or prompt an environment returned cannot become token ids."""


class TurnCodec:
    """Text <-> ids for one run's episodes: `tokenizer` (or None), the model's vocabulary size,
    rollout.stop_strings (they need a tokenizer)."""

    def __init__(self, tokenizer, vocab_size: int, stop_strings: Sequence[str] = ()):
        if stop_strings and tokenizer is None:
            raise ValueError(
                "rollout.stop_strings needs a model with a tokenizer (stop strings are text); "
                "the model has none"
            )
        self.tokenizer, self.vocab_size, self.stop_strings = tokenizer, vocab_size, stop_strings

    # ------------------------------------------------------------------ model turns

    def text(self, ids: Sequence[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def stop_cut(self, ids: Sequence[int]) -> int | None:
        """How many of `ids` to keep: up to the token completing the first stop string; None
        when no stop string occurs."""
        if not self.stop_strings or not self._has_stop(ids):
            return None
        return next(k for k in range(1, len(ids) + 1) if self._has_stop(ids[:k]))

    def _has_stop(self, ids: Sequence[int]) -> bool:
        text = self.tokenizer.decode(list(ids), skip_special_tokens=False)
        return any(s in text for s in self.stop_strings)

    # ------------------------------------------------------------------ what the environment returns

    def observation_ids(self, observation) -> list[int]:
        """The ids an observation adds to the episode (None: none)."""
        if observation is None:
            return []
        if isinstance(observation, str):
            return self._checked(self._tool_ids(observation), "the observation")
        if is_token_list(observation):
            return self._checked([int(t) for t in observation], "the observation")
        raise ObservationError(
            f"an observation must be None, text or a list of token ids, got "
            f"{type(observation).__name__} {observation!r:.80}"
        )

    def prompt_ids(self, prompt) -> list[int]:
        """The episode's prompt from what `reset` returned (not None)."""
        if is_token_list(prompt):
            ids = [int(t) for t in prompt]
        elif isinstance(prompt, str):
            ids = self._messages_ids([{"role": "user", "content": prompt}])
        elif isinstance(prompt, list) and all(_is_message(m) for m in prompt):
            ids = self._messages_ids(prompt)
        else:
            raise ObservationError(
                "reset must return None, token ids, text or chat messages ({role, content}), "
                f"got {type(prompt).__name__} {prompt!r:.80}"
            )
        if not ids:
            raise ObservationError("reset returned an empty prompt")
        return self._checked(ids, "reset's prompt")

    def _messages_ids(self, messages: list[dict]) -> list[int]:
        self._need_tokenizer("a text prompt")
        return encode_messages(self.tokenizer, messages)

    def _tool_ids(self, text: str) -> list[int]:
        self._need_tokenizer("a text observation")
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            return list(tok.encode(text, add_special_tokens=False))
        try:
            head = tok.apply_chat_template(_BEFORE_TOOL, tokenize=False)
            full = tok.apply_chat_template(
                [*_BEFORE_TOOL, {"role": "tool", "content": text}],
                add_generation_prompt=True,
                tokenize=False,
            )
        except Exception as err:  # jinja's own errors: the template refuses a tool message
            raise ValueError(
                f"the tokenizer's chat template cannot render a 'tool' message ({err}); the "
                "environment must return token ids as observations with this model"
            ) from None
        if not full.startswith(head):
            raise ValueError(
                "the tokenizer's chat template renders a conversation differently once a tool "
                "message follows, so a tool message cannot be appended to a running episode; "
                "the environment must return token ids as observations with this model"
            )
        return list(tok.encode(full[len(head) :], add_special_tokens=False))

    def _need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise ObservationError(
                f"{what} needs a model with a tokenizer; this model has none: return token ids"
            )

    def _checked(self, ids: list[int], what: str) -> list[int]:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ObservationError(
                f"{what} holds token id {bad[0]}, outside the vocabulary of {self.vocab_size}"
            )
        return ids


def _is_message(message) -> bool:
    return (
        isinstance(message, dict)
        and isinstance(message.get("role"), str)
        and isinstance(message.get("content"), str)
    )
