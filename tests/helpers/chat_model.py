"""A tiny real Hugging Face chat model for data/reward tests: tiny-llama weights saved as a
folder with a word-level tokenizer (1000 words, one per model id) and a chat template."""

from __future__ import annotations

from pathlib import Path

WORDS = [
    "[UNK]", "[BOS]", "[EOS]", "user", "assistant", "system", ":", "?", ".", ",", "what",
    "is", "plus", "the", "answer", "#", "{", "}", "\\", "boxed", "be", "brief",
]  # fmt: skip
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def vocabulary(size: int = 1000) -> dict[str, int]:
    words = WORDS + [str(n) for n in range(200)]
    words += [f"w{i}" for i in range(size - len(words))]
    return {w: i for i, w in enumerate(words)}


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocabulary(), unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_chat_model(folder: Path, seed: int = 3) -> Path:
    """tiny-llama (vocab 1000, fp32) with the tokenizer above, as a from_pretrained folder."""
    from rl_engine.models import load_model

    model, _ = load_model("tiny-llama", seed=seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return folder
