"""Text <-> ids of episodes: stop strings cut a turn after the token that completes one, text
observations go through the chat template's tool role, reset's prompts in their three forms,
and what an environment returns wrong is an ObservationError (counted, never fatal)."""

from __future__ import annotations

import pytest

from rl_engine.envs import ObservationError, TurnCodec
from tests.helpers.chat_model import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_a_turn_is_cut_after_the_token_that_completes_a_stop_string(tok):
    codec = TurnCodec(tok, 1000, ["the answer", "#"])
    turn = ids(tok, "what is the answer 5 plus 3")
    assert codec.stop_cut(turn) == 4  # "what is the answer"
    assert codec.stop_cut(ids(tok, "5 plus # 3")) == 3
    assert codec.stop_cut(ids(tok, "5 plus 3")) is None
    assert TurnCodec(tok, 1000).stop_cut(turn) is None  # no stop strings: never cut


def test_stop_strings_need_a_tokenizer():
    with pytest.raises(ValueError, match="rollout.stop_strings needs a model with a tokenizer"):
        TurnCodec(None, 1000, ["</calc>"])


def test_text_observations_are_tool_messages_of_the_chat_template(tok):
    codec = TurnCodec(tok, 1000)
    # the template renders a message as "role : content . " and ends with "assistant :"
    assert codec.observation_ids("21") == ids(tok, "tool : 21 . assistant :")
    assert codec.observation_ids([7, 8]) == [7, 8] and codec.observation_ids(None) == []
    plain = build_tokenizer()
    plain.chat_template = None
    assert TurnCodec(plain, 1000).observation_ids("21 plus") == ids(tok, "21 plus")


def test_a_template_that_refuses_a_tool_message_stops_the_run(tok):
    strict = build_tokenizer()
    strict.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
        "{% endif %}{{ m['role'] }} : {{ m['content'] }} . {% endfor %}"
    )
    with pytest.raises(ValueError, match="cannot render a 'tool' message") as err:
        TurnCodec(strict, 1000).observation_ids("21")
    assert not isinstance(err.value, ObservationError)  # the run's problem, not the episode's


@pytest.mark.parametrize(
    ("observation", "message"),
    [
        ({"text": "21"}, "must be None, text or a list of token ids"),
        ([1, 2.5], "must be None, text or a list of token ids"),
        ([1, 1000], "token id 1000, outside the vocabulary of 1000"),
        ([-1], "token id -1, outside"),
    ],
)
def test_bad_observations_are_observation_errors(tok, observation, message):
    with pytest.raises(ObservationError, match=message):
        TurnCodec(tok, 1000).observation_ids(observation)


def test_text_needs_a_tokenizer():
    codec = TurnCodec(None, 100)
    assert codec.text([5, 6]) is None
    with pytest.raises(ObservationError, match="a text observation needs a model with a tokenizer"):
        codec.observation_ids("21")
    with pytest.raises(ObservationError, match="a text prompt needs a model with a tokenizer"):
        codec.prompt_ids("What is 2 plus 2?")
    assert codec.prompt_ids([4, 5, 6]) == [4, 5, 6]


def test_reset_prompts_as_ids_text_or_messages(tok):
    codec = TurnCodec(tok, 1000)
    text = codec.prompt_ids("what is 2 plus 2 ?")
    assert text == ids(tok, "user : what is 2 plus 2 ? . assistant :")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2"}]
    assert codec.prompt_ids(messages) == ids(tok, "system : be brief . user : 2 . assistant :")
    assert codec.text(text[:3]) == "user : what"
    for bad in ([], [{"role": "user"}], 3.0):
        with pytest.raises(ObservationError):
            codec.prompt_ids(bad)
