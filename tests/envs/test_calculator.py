"""The Calculator environment (rl_engine/envs/calculator.py), and the shipped environments'
data files in configs/data/ (the calculator's and the guessing game's, as
scripts/make_env_data.py writes them; the game itself: test_guess_number.py).

Calculator: `<calc>EXPR</calc>` at the end of a turn is a tool call whose observation is
EXPR's value, evaluated by an AST walk over numbers and + - * / ( ) only; any other turn is
the answer.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from rl_engine.config import DataConfig
from rl_engine.data import check_dataset
from rl_engine.envs import load_environment
from rl_engine.envs.calculator import Calculator, evaluate, format_value
from rl_engine.envs.guess_number import GuessNumber

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "configs" / "data"


@pytest.mark.parametrize(
    ("expression", "value"),
    [("3*7", 21), (" (1 + 2) * 3 / 4 ", 2.25), ("-3 - -4", 1), ("10/4", 2.5), ("2.5*2", 5.0)],
)
def test_evaluate_computes_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('true')",
        "a + 1",
        "2 ** 64",
        "7 // 2",
        "7 % 2",
        "0x1F",
        "1e308 * 10",
        "abs(-1)",
        "(1).real",
        "",
        "1 +",
        "9" * 201,
        "[1, 2]",
    ],
)
def test_evaluate_refuses_anything_but_numbers_and_four_operators(expression):
    with pytest.raises(ValueError):
        evaluate(expression)


def test_arithmetic_errors_become_error_observations():
    assert Calculator.result("1/0") == "error: division by zero"
    assert Calculator.result("9" * 150 + "/3") == "3" * 150  # ints that divide: exact
    assert Calculator.result("1e3") == "error: only numbers and + - * / ( ) are allowed"
    assert Calculator.result("2 ** 3") == "error: only numbers and + - * / ( ) are allowed"
    assert (format_value(21), format_value(2.0), format_value(1 / 3)) == ("21", "2", "0.3333333333")
    assert format_value(1e20) == "1e+20"


def test_calculator_turns_are_calls_or_the_answer():
    env = load_environment("rl_engine.envs.calculator:Calculator")()
    assert env.reset({"prompt_ids": [1], "answer": "1476"}) is None
    assert env.step({"completion": "Let me compute <calc>82 * 18</calc>"}) == ("1476", 0.0, False)
    assert env.step({"completion": "<calc>82*18</calc>\n"}) == ("1476", 0.0, False)
    # a call that does not end the turn is not a call: the turn is the answer
    assert env.step({"completion": "<calc>1+1</calc> so 2"}) == (None, 0.0, True)
    assert env.step({"completion": "The answer is 1476."}) == (None, 1.0, True)
    assert env.step({"completion": "1476 or 1477"}) == (None, 0.0, True)
    custom = Calculator(open_tag="[[", close_tag="]]")
    custom.reset({"answer": "4"})
    assert custom.step({"completion": "[[2+2]]"}) == ("4", 0.0, False)
    with pytest.raises(ValueError, match="needs a model with a tokenizer"):
        env.step({"completion_ids": [5], "completion": None})


def test_the_data_files_are_what_the_script_writes(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "make_env_data", REPO / "scripts/make_env_data.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--out", str(tmp_path)])
    for name in ("calculator_train.jsonl", "calculator_val.jsonl", "guess_number.jsonl"):
        assert (tmp_path / name).read_text() == (DATA / name).read_text(), name


def test_the_data_files_load_as_datasets_and_their_answers_are_right():
    data = DataConfig()
    train = check_dataset([str(DATA / "calculator_train.jsonl")], data, key="data.train_files")
    val = check_dataset([str(DATA / "calculator_val.jsonl")], data, key="data.val_files")
    assert (len(train), len(val)) == (256, 64)
    questions = {r.extra_info["expression"] for r in train}
    assert not questions & {r.extra_info["expression"] for r in val}  # held out
    for r in train + val:
        assert r.ground_truth == format_value(evaluate(r.extra_info["expression"]))
        assert r.messages[0]["content"] == f"What is {r.extra_info['expression']}?"
    games = check_dataset([str(DATA / "guess_number.jsonl")], data, key="data.train_files")
    assert sorted(int(r.ground_truth) for r in games) == list(range(1, 101))
    for r in games[:3]:
        GuessNumber().reset({"answer": r.ground_truth})
