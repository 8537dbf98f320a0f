"""The TP sharding plan and config checks: impossible degrees are errors naming the dimension."""

from __future__ import annotations

import pytest

from rl_engine.config import RolloutConfig, RunConfig
from rl_engine.models.tiny import TINY_CONFIGS
from rl_engine.rollout.tp import TPLayout, check_tensor_parallel_size


@pytest.mark.parametrize("bad", [0, 3, 8, True, 2.0, "2"])
def test_degree_must_be_1_2_or_4(bad):
    with pytest.raises(ValueError, match="rollout.tensor_parallel_size must be one of 1, 2, 4"):
        check_tensor_parallel_size(bad)
    with pytest.raises(
        ValueError, match=r"rollout.tensor_parallel_size must be one of \[1, 2, 4\]"
    ):
        RolloutConfig(tensor_parallel_size=bad)


def test_config_default_is_one():
    assert RolloutConfig().tensor_parallel_size == 1
    assert RolloutConfig(tensor_parallel_size=4).tensor_parallel_size == 4


def test_query_heads_must_divide():
    config = TINY_CONFIGS["tiny-llama"]()  # 6 query heads
    with pytest.raises(ValueError, match=r"query heads \(num_attention_heads 6\).*by 4"):
        TPLayout.from_config(config, 4)


def test_kv_heads_must_divide_or_be_divided():
    config = TINY_CONFIGS["tiny-mistral"]()
    config.num_attention_heads, config.num_key_value_heads = 6, 3
    with pytest.raises(ValueError, match=r"KV heads \(num_key_value_heads 3\)"):
        TPLayout.from_config(config, 2)


def test_moe_is_refused_by_name():
    with pytest.raises(ValueError, match="mixture-of-experts.*num_experts"):
        TPLayout.from_config(TINY_CONFIGS["tiny-qwen3-moe"](), 2)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("vocab", [1000, 1003, 999])
def test_uneven_shards_cover_every_row_once(world, vocab):
    layout = TPLayout(world, 8, 4, 16, 201, vocab)
    for kind, size in (("vocab", vocab), ("mlp", 201)):
        spans = [layout.rows(kind, r) for r in range(world)]
        assert spans[0][0] == 0 and spans[-1][1] == size
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert max(layout.widths(kind)) - min(layout.widths(kind)) <= 1
    assert sum(layout.widths("vocab")) == vocab


def test_fewer_kv_heads_than_ranks_are_replicated():
    layout = TPLayout(4, 8, 2, 16, 64, 100)
    assert [layout.kv_heads(r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    # every rank's query heads read exactly its KV head (4 query heads per KV head)
    for r in range(4):
        q0, q1 = layout.query_heads(r)
        assert {q // 4 for q in range(q0, q1)} == {layout.kv_heads(r)[0]}


def test_config_and_layout_accept_the_same_degrees():
    from rl_engine import config
    from rl_engine.rollout.tp import TENSOR_PARALLEL_SIZES

    assert config.TENSOR_PARALLEL_SIZES == TENSOR_PARALLEL_SIZES


def test_the_job_refuses_an_impossible_degree_before_ray_starts(tmp_path):
    from rl_engine.executors.job.preflight import validate_before_start

    config = RunConfig.from_dict(
        {"model": "tiny-llama", "output_dir": str(tmp_path), "rollout": {"tensor_parallel_size": 4}}
    )
    with pytest.raises(ValueError, match=r"query heads \(num_attention_heads 6\)"):
        validate_before_start(config)
    moe = RunConfig.from_dict(
        {
            "model": "tiny-qwen3-moe",
            "output_dir": str(tmp_path),
            "rollout": {"tensor_parallel_size": 2},
        }
    )
    with pytest.raises(ValueError, match="mixture-of-experts"):
        validate_before_start(moe)


def test_model_config_of_a_folder_reads_no_weights(tmp_path):
    from rl_engine.models import model_config

    TINY_CONFIGS["tiny-qwen3"]().save_pretrained(tmp_path)  # config.json only
    config = model_config(tmp_path)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert TPLayout.from_config(config, 4).kv_heads(3) == (1, 2)
