"""The ``calculator`` environment: a `ToolEnvironment` with one tool that evaluates arithmetic.

The policy may call ``calculator(expression)`` (``+ - * /``, parentheses, decimal numbers), reads the
result as a ``tool`` message, and answers with ``#### number``; the answer is scored as in
`skylift.envs.final_answer` (1.0 when right). It is the task of ``skylift demo --task tools``
(`skylift.data.tool_demo`), where a small model learns to call the tool for products it cannot
work out in its head.

Config (``environment.env_kwargs``), besides `ToolEnvironment`'s (``tool_parser`` defaults to
``xml``: ``<tool name="calculator">{"expression": "12 * 345"}</tool>``, as models without a tool
template are taught by the prompt):

- ``call_reward`` (default 0): reward shaping, added once per trajectory on the first turn whose
  calls all ran without error (a well-formed call of a known tool with valid arguments).

Step metrics (``env/<name>``, summed per trajectory): ToolEnvironment's, ``used_tool`` (1 when
the trajectory called a tool at all, well-formed or not: its mean is the tool-call rate) and
``correct`` (1 when the answer was right: its mean is the accuracy, also with ``call_reward``).
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

from skylift.envs.base import StepResult
from skylift.envs.final_answer import FinalAnswerEnv
from skylift.envs.registry import register_env
from skylift.envs.tools import ToolEnvironment

#: the longest expression the calculator reads (a size the caller controls, checked first)
MAX_EXPRESSION_CHARS = 200

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic the calculator reads."""


def evaluate_expression(expression: str) -> int | float:
    """The value of `expression` (numbers, ``+ - * /``, parentheses; ``x`` and ``×`` read as ``*``).

    Anything else (names, calls, powers, more than `MAX_EXPRESSION_CHARS` characters) raises
    `CalculatorError`; a division by zero raises ZeroDivisionError.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    text = expression.replace("×", "*").replace("x", "*").replace("X", "*").replace(",", "")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from None

    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value  # type: ignore[no-any-return]
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](value(node.left), value(node.right))  # type: ignore[no-any-return]
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))  # type: ignore[no-any-return]
        raise CalculatorError(f"only numbers, + - * / and parentheses are allowed: {expression!r}")

    return value(tree.body)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / and parentheses, for example "12 * 345"
    """
    result = evaluate_expression(expression)
    if isinstance(result, float) and result.is_integer():
        result = int(result)
    return str(round(result, 6) if isinstance(result, float) else result)


@register_env("calculator")
class CalculatorEnv(ToolEnvironment, FinalAnswerEnv):
    """Arithmetic with a calculator tool: call it any number of turns, then answer ``#### n``."""

    tools = (calculator,)

    def __init__(self, tool_parser: str = "xml", call_reward: float = 0.0, **config: Any) -> None:
        super().__init__(tool_parser=tool_parser, call_reward=call_reward, **config)
        self.call_reward = float(call_reward)
        self._called = False
        self._rewarded_call = False

    def answer(self, action: str) -> StepResult:
        reward, metadata = self.score(action)
        metadata["used_tool"] = self._called
        self.done = True
        metrics = {"correct": float(metadata["correct"])}
        return StepResult(observations=[], reward=reward, done=True, metadata=metadata, metrics=metrics)

    async def step(self, action: str) -> StepResult:
        result = await super().step(action)
        result.metrics.setdefault("correct", 0.0)  # every trajectory reports it (a mean over all)
        calls = result.metrics.get("tool_calls", 0.0) + result.metrics.get("tool_parse_failures", 0.0)
        if calls and not self._called:
            self._called = True
            result.metrics["used_tool"] = 1.0
        clean = result.metrics.get("tool_calls", 0.0) > 0 and not (
            result.metrics.get("tool_errors", 0.0) or result.metrics.get("tool_parse_failures", 0.0)
        )
        if clean and self.call_reward and not self._rewarded_call:
            self._rewarded_call = True
            result.reward += self.call_reward
        return result
