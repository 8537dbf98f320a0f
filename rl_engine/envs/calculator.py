"""`Calculator`: a calculator tool for arithmetic questions (`rollout.env:
rl_engine.envs.calculator:Calculator`; data: configs/data/calculator_*.jsonl).

Each model turn either calls the tool or answers:
- a turn that ends with `<calc>EXPR</calc>` (set `rollout.stop_strings: ["</calc>"]` so the
  turn stops there) is a call: the observation is EXPR's value (or `error: ...`), reward 0;
- any other turn is the answer: reward 1.0 when its final answer is the record's `answer`
  (the rule of the `arithmetic` task: the turn's last number), and the episode is done.

EXPR is parsed with `ast` and evaluated over numbers and + - * / ( ) only (`evaluate`):
never `eval`, no names, no calls, no powers, at most MAX_CHARS characters.
"""

from __future__ import annotations

import ast
import operator
import re

from rl_engine.data.tasks import answer_matches

MAX_CHARS = 200
_ALLOWED = re.compile(r"^[0-9+\-*/().\s]+$")


def _divide(a: int | float, b: int | float) -> int | float:
    """Exact for ints that divide (a float quotient of big ints would lose digits)."""
    if isinstance(a, int) and isinstance(b, int) and b and a % b == 0:
        return a // b
    return a / b


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: _divide}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression of numbers and + - * / ( ); ValueError otherwise
    (ZeroDivisionError / OverflowError for what arithmetic refuses)."""
    text = expression.strip()
    if not text or len(text) > MAX_CHARS:
        raise ValueError(f"an expression of 1 to {MAX_CHARS} characters is expected")
    if not _ALLOWED.match(text):
        raise ValueError("only numbers and + - * / ( ) are allowed")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError("not an arithmetic expression") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_value(node.left), _value(node.right))
    raise ValueError("only numbers and + - * / ( ) are allowed")


def format_value(value: int | float) -> str:
    """An int as it is; a float with up to 10 significant digits (a small integral one as an
    int: 2.0 -> 2)."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.10g}"


class Calculator:
    """The calculator environment (module docstring); env_args: `open_tag`, `close_tag`."""

    def __init__(self, open_tag: str = "<calc>", close_tag: str = "</calc>"):
        self.call = re.compile(re.escape(open_tag) + r"(.*?)" + re.escape(close_tag), re.DOTALL)
        self.answer = None

    def reset(self, record: dict) -> None:
        self.answer = record.get("answer")
        return None

    def step(self, turn: dict) -> tuple[str | None, float, bool]:
        text = turn["completion"]
        if text is None:
            raise ValueError("the calculator reads text: it needs a model with a tokenizer")
        calls = list(self.call.finditer(text))
        if calls and not text[calls[-1].end() :].strip():  # the turn ends with a call
            return self.result(calls[-1].group(1)), 0.0, False
        correct = self.answer is not None and answer_matches(text, str(self.answer))
        return None, 1.0 if correct else 0.0, True

    @staticmethod
    def result(expression: str) -> str:
        try:
            return format_value(evaluate(expression))
        except (ValueError, ArithmeticError) as err:
            return f"error: {err}"
