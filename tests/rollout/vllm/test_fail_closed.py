"""With RL_ENGINE_BATCH_INVARIANT=1 a model, dtype or feature that cannot keep the trainer's
bits raises ExactVllmUnsupported naming it; each case is paired with the supported config
it differs from, which passes (negative control). The configs are vLLM's own
(`EngineArgs.create_engine_config`), the engine is started once to show the refusal
reaches the user."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from rl_engine.rollout.vllm.folders import write_folder
from tests.helpers.rollout.vllm.common import REPO, engine_failure, require_vllm

require_vllm()

from rl_engine.rollout.vllm import ENV_VAR, enabled  # noqa: E402
from rl_engine.rollout.vllm.checks import (  # noqa: E402
    ExactVllmUnsupported,
    check_attention_metadata,
    check_vllm_config,
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": write_folder("tiny-llama", torch.float32, root),
        "moe": write_folder("tiny-qwen3-moe", torch.float32, root),
    }


def engine_config(folder, **overrides):
    from vllm.engine.arg_utils import EngineArgs

    args = {"model": str(folder), "max_model_len": 512, "block_size": 32, "dtype": "float32"}
    return EngineArgs(skip_tokenizer_init=True, **{**args, **overrides}).create_engine_config()


def test_the_supported_config_passes(folders):
    check_vllm_config(engine_config(folders["llama"]))
    check_vllm_config(engine_config(folders["llama"], dtype="bfloat16"))


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"dtype": "float16"}, "dtype torch.float16"),
        ({"enable_lora": True}, "LoRA"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype 'fp8'"),
        ({"logprobs_mode": "processed_logprobs"}, "logprobs_mode 'processed_logprobs'"),
    ],
    ids=["fp16", "lora", "fp8-kv-cache", "processed-logprobs"],
)
def test_an_unsupported_setting_is_named(folders, overrides, named):
    with pytest.raises(ExactVllmUnsupported, match=named):
        check_vllm_config(engine_config(folders["llama"], **overrides))


def test_a_mixture_of_experts_model_is_refused(folders):
    with pytest.raises(ExactVllmUnsupported, match="mixture-of-experts model_type 'qwen3_moe'"):
        check_vllm_config(engine_config(folders["moe"]))


def test_an_unsupported_model_family_is_named(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=300)).save_pretrained(
        tmp_path
    )
    with pytest.raises(ExactVllmUnsupported, match="model_type .gpt2."):
        check_vllm_config(engine_config(tmp_path))


def test_an_unsupported_head_size_is_named(tmp_path):
    from transformers import AutoModelForCausalLM

    from rl_engine.models.tiny import TINY_CONFIGS

    config = TINY_CONFIGS["tiny-llama"]()  # head_dim 16: vLLM's CPU cache takes 32, 64, ...
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(ExactVllmUnsupported, match="head size 16"):
        check_vllm_config(engine_config(tmp_path))


def test_another_attention_backend_is_refused():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

    with pytest.raises(ExactVllmUnsupported, match="metadata FlashAttentionMetadata of layer 'l0'"):
        check_attention_metadata("l0", type("FlashAttentionMetadata", (), {})())
    plain = CPUAttentionMetadata(
        num_actual_tokens=1,
        max_query_len=1,
        query_start_loc=torch.tensor([0, 1]),
        max_seq_len=1,
        seq_lens=torch.tensor([1]),
        block_table=torch.zeros(1, 1, dtype=torch.int32),
        slot_mapping=torch.tensor([0]),
        scheduler_metadata=None,
    )
    check_attention_metadata("l0", plain)


def test_the_variable_takes_0_or_1(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "yes")
    with pytest.raises(ValueError, match="RL_ENGINE_BATCH_INVARIANT='yes'"):
        enabled()
    monkeypatch.setenv(ENV_VAR, "1")
    assert enabled()
    monkeypatch.delenv(ENV_VAR)
    assert not enabled()


REGISTRY_PROBE = """
import vllm.plugins as plugins
from vllm import ModelRegistry
plugins.load_general_plugins()
print(ModelRegistry.models["LlamaForCausalLM"].__class__.__name__,
      getattr(ModelRegistry.models["GPT2LMHeadModel"], "class_name", "vllm's own"))
"""


@pytest.mark.exhaustive  # ~30 s; every plain-vLLM negative control runs without the variable too
@pytest.mark.multiprocess
def test_the_plugin_changes_nothing_without_the_variable():
    """With the variable, every architecture resolves to ExactCausalLM (GPT-2 too: it is
    refused there); without it, vLLM's registry is untouched."""

    def probe(value):
        env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
        if value is not None:
            env[ENV_VAR] = value
        env["PYTHONPATH"] = str(REPO)
        out = subprocess.run(
            [sys.executable, "-c", REGISTRY_PROBE], env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout.split()[-2:]

    assert probe("1") == ["_LazyRegisteredModel", "ExactCausalLM"]
    assert probe(None)[1] != "ExactCausalLM"
    assert probe("0")[1] != "ExactCausalLM"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_engine_refuses_to_start_and_says_why(folders):
    output = engine_failure(folders["moe"], torch.float32, max_num_seqs=1)
    assert "ExactVllmUnsupported" in output
    assert "mixture-of-experts model_type 'qwen3_moe'" in output
