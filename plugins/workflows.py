"""Built-in plugin: rollout workflows (``rollout.workflow``) and the ``env_reward`` reward function.

* ``single_turn``: one sampled completion per sample, scored by the reward functions (the default).
* ``calculator``: a tool environment. A turn that is an arithmetic expression ending in ``=``
  (``"17*23="``) calls the calculator, whose answer (``"391"``) comes back as the next observation;
  any other turn is the final answer, rewarded 1 when it equals the sample's ``answer`` (minus
  ``call_cost`` per calculator call) and the episode ends.
* ``arithmetic_chain``: a multi-step arithmetic game. The prompt is the first problem (the ``addition``
  task's ``"a+b="``); each answer earns ``1/steps`` when right, and the environment poses the next
  problem, ``steps`` in all, drawn from the prompt's text so every sample of a group gets the same ones.
  Each problem arrives as a user message in the prompt's own format, which the quickstart model knows.

Environments read the turn's text (``Action.text``); what the trainer trains on are the sampled tokens
and the observation tokens, never a re-encoding of that text (``rlite.workflows``).
"""

from __future__ import annotations

import ast
import operator
import random
import zlib
from dataclasses import dataclass
from typing import Any

from rlite.api import Action, SingleTurn, hookimpl

# --------------------------------------------------------------------------------------------------
# calculator
# --------------------------------------------------------------------------------------------------

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str, max_abs: int = 10**12) -> int | None:
    """The value of an integer expression of ``+ - *``, parentheses and unary minus; ``None`` for
    anything else (names, calls, division, numbers over ``max_abs``): no ``eval``."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError):
        return None

    def value(node) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            result = node.value
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            result = _OPERATORS[type(node.op)](value(node.left), value(node.right))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            result = -value(node.operand)
        else:
            raise ValueError("not an integer expression")
        if abs(result) > max_abs:
            raise ValueError("too large")
        return result

    try:
        return value(tree.body)
    except ValueError:
        return None


@dataclass
class CalculatorConfig:
    """Options of ``calculator``."""

    call_cost: float = 0.0
    """Subtracted from the reward for every calculator call."""


class Calculator:
    def __init__(self, cfg: CalculatorConfig) -> None:
        self.cfg, self.answer, self.calls, self.correct = cfg, "", 0, False

    def reset(self, sample: dict[str, Any]) -> None:
        self.answer, self.calls, self.correct = str(sample.get("answer", "")).strip(), 0, False
        return None

    def metrics(self) -> dict[str, float]:
        """``tool_calls`` (calculator calls in the episode), ``used_tool`` (1 when there was one) and
        ``correct`` (the final answer was right, whatever the calls cost)."""
        return {"tool_calls": self.calls, "used_tool": float(self.calls > 0), "correct": float(self.correct)}

    def step(self, action: Action) -> tuple[str | None, float, bool]:
        text = action.text.strip()
        if text.endswith("=") and any(op in text[:-1] for op in "+-*"):
            result = calculate(text[:-1])
            self.calls += 1
            return ("error" if result is None else str(result)), -self.cfg.call_cost, False
        self.correct = text == self.answer
        return None, float(self.correct), True


# --------------------------------------------------------------------------------------------------
# arithmetic_chain
# --------------------------------------------------------------------------------------------------


@dataclass
class ArithmeticChainConfig:
    """Options of ``arithmetic_chain``."""

    steps: int = 3
    """Problems per episode (the prompt's and ``steps - 1`` more)."""
    digits: int = 2
    """Digits of the operands of the problems the environment poses."""

    def __post_init__(self) -> None:
        if self.steps < 1 or not 1 <= self.digits <= 9:
            raise ValueError(f"need steps >= 1 and 1 <= digits <= 9, got steps={self.steps}, digits={self.digits}")


class ArithmeticChain:
    def __init__(self, cfg: ArithmeticChainConfig) -> None:
        self.cfg = cfg
        self.answers: list[str] = []
        self.problems: list[str] = []
        self.right: list[bool] = []

    def reset(self, sample: dict[str, Any]) -> None:
        if "answer" not in sample:
            raise ValueError("arithmetic_chain: the data rows need an 'answer' (use data.task=addition)")
        rng = random.Random(zlib.crc32(str(sample.get("prompt", "")).encode()))
        self.answers, self.problems, self.right = [str(sample["answer"]).strip()], [], []
        for _ in range(self.cfg.steps - 1):
            a, b = rng.randrange(10**self.cfg.digits), rng.randrange(10**self.cfg.digits)
            self.problems.append(f"{a}+{b}=")
            self.answers.append(str(a + b))
        return None

    def metrics(self) -> dict[str, float]:
        """``turn_<i>_correct`` for every problem (0 when the episode ended before it) and ``correct``
        (every problem answered right)."""
        right = self.right + [False] * (self.cfg.steps - len(self.right))
        return {**{f"turn_{i}_correct": float(r) for i, r in enumerate(right)}, "correct": float(all(right))}

    def step(self, action: Action) -> tuple[str | None, float, bool]:
        self.right.append(action.text.strip() == self.answers[action.turn])
        reward = float(self.right[-1]) / self.cfg.steps
        if action.turn + 1 >= self.cfg.steps:
            return None, reward, True
        return self.problems[action.turn], reward, False


# --------------------------------------------------------------------------------------------------
# env_reward
# --------------------------------------------------------------------------------------------------


@dataclass
class EnvRewardConfig:
    """Options of ``env_reward``."""

    weight: float = 1.0
    """Weight of this function in the summed reward."""


def env_reward(completion: str, sample: dict[str, Any], cfg: EnvRewardConfig) -> float:
    """The environment's rewards, summed over the trajectory: ``sample["env_reward"]``, which the reward
    runner's caller adds to the data row of a multi-turn sample (:func:`rlite.reward_runner.reward_samples`)."""
    if "env_reward" not in sample:
        raise KeyError("env_reward: the sample has no environment reward; set rollout.workflow to an environment")
    return float(sample["env_reward"])


@hookimpl
def register_rollout_workflows(register):
    register("single_turn", lambda cfg, tokenizer: SingleTurn(), single_turn=True)
    register("calculator", lambda cfg, tokenizer: Calculator(cfg), CalculatorConfig)
    register("arithmetic_chain", lambda cfg, tokenizer: ArithmeticChain(cfg), ArithmeticChainConfig)


@hookimpl
def register_reward_functions(register):
    register("env_reward", env_reward, EnvRewardConfig)
