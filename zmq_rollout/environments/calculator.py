"""A calculator tool environment: the model may call ``calculator`` and then answers.

The sample is ``{"question": "What is 12 * 7?", "answer": 84}``. The model calls the tool
in the Hermes/Qwen format, ``<tool_call>{"name": "calculator", "arguments": {"expression":
"12 * 7"}}</tool_call>``, and gets a ``tool`` message with the result (or with what was
wrong: a garbage call costs the model a turn, never the episode). A turn without a tool
call is the final answer: its last number is compared with the answer (reward 1 or 0).
Expressions are evaluated on their syntax tree (numbers, + - * / // % **, parentheses),
never with ``eval``.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from typing import Any

from .base import Action, Environment, Observation, StepResult

SYSTEM = (
    "You can use a calculator. To use it, write "
    '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 2"}}</tool_call> '
    "and wait for the result. When you know the answer, reply with the number alone."
)
_OPS: dict[type, Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def evaluate(expression: str) -> float:
    """The value of an arithmetic expression; ``ValueError`` saying what is not allowed."""
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an expression: {exc.msg}") from None

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return float(node.value) if isinstance(node.value, float) else int(node.value)  # type: ignore[arg-type]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.operand))
        raise ValueError(f"{type(node).__name__} is not allowed")

    try:
        value = walk(tree)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    if not math.isfinite(value):
        raise ValueError("the result is not finite")
    return value


def _format(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


class CalculatorEnvironment(Environment):
    def __init__(self, max_calls: int = 4) -> None:
        self.max_calls = max_calls
        self.calls = 0
        self.answer: float | None = None

    async def reset(self, sample: Any) -> Observation:
        if not (isinstance(sample, dict) and "question" in sample):
            raise ValueError('a calculator sample is {"question": ..., "answer": ...}')
        self.calls = 0
        self.answer = None if sample.get("answer") is None else float(sample["answer"])
        return Observation(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": str(sample["question"])}]
        )

    async def step(self, action: Action) -> StepResult:
        if action.tool_calls:
            self.calls += 1
            call = action.tool_calls[0]
            if call.name != "calculator":
                result = f"error: unknown tool {call.name!r}; the tool is calculator"
            else:
                try:
                    result = _format(evaluate(str(call.arguments.get("expression", ""))))
                except ValueError as exc:
                    result = f"error: {exc}"
            done = self.calls >= self.max_calls
            info = {"calls": self.calls, "last_result": result}
            return StepResult(None if done else Observation.of({"role": "tool", "content": result}), 0.0, done, info)
        numbers = _NUMBER.findall(action.text)
        given = float(numbers[-1]) if numbers else None
        correct = given is not None and self.answer is not None and math.isclose(given, self.answer)
        return StepResult(None, 1.0 if correct else 0.0, True, {"calls": self.calls, "given": given})
