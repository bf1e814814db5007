"""A built-in tool environment: arithmetic with a calculator (`env.class:
'rlhflab.envs.arithmetic:CalculatorEnv'`).

Each episode is one task problem (e.g. reasoning_gym's `basic_arithmetic` or `chain_sum` with
large numbers). On each turn the model either calls the calculator, ``<tool>calc: 4821*37</tool>``
(the tagged format; the Hermes/Qwen ``<tool_call>`` JSON is accepted too), and reads its result
as the next user message, or answers; the answer (``<answer>N</answer>`` with `answer_format:
tags`, else the turn's last number) is scored by the task's verifier and ends the episode.
Reward: the verifier's score of the answer (binary unless `partial`), minus `call_cost` per tool
call (0 by default). An episode that ends without an answer (turn or token limit) gets 0.
"""

from __future__ import annotations

from rlhflab.envs.base import Environment
from rlhflab.envs.tools import parse_tool_call
from rlhflab.rewards.verifier import Verifier

__all__ = ["CalculatorEnv"]

INSTRUCTION = "Use <tool>calc: EXPR</tool> to compute, then answer <answer>N</answer>."


class CalculatorEnv(Environment):
    """Arithmetic with a calculator tool (see the module docstring).

    Args:
        answer_format: "tags" or "last_number", how the final answer is read.
        instruction: appended to the question after a blank line ("" for none).
        call_cost: subtracted from the reward per tool call (>= 0).
        partial: reward the verifier's partial score instead of 0/1.
    """

    def __init__(
        self,
        answer_format: str = "tags",
        instruction: str = INSTRUCTION,
        call_cost: float = 0.0,
        partial: bool = False,
    ) -> None:
        if answer_format not in ("tags", "last_number"):
            raise ValueError(
                f"answer_format must be 'tags' or 'last_number', got {answer_format!r}"
            )
        if call_cost < 0:
            raise ValueError(f"call_cost must be >= 0, got {call_cost}")
        self.verifier = Verifier(
            answer_format=answer_format, reward="partial" if partial else "binary"
        )
        self.instruction = instruction
        self.call_cost = call_cost
        self.problem = None

    def reset(self, problem) -> list[dict]:
        """One user message: the question, a blank line, the tool instruction."""
        self.problem = problem
        text = f"{problem.question}\n\n{self.instruction}" if self.instruction else problem.question
        return [{"role": "user", "content": text}]

    def step(self, messages: list[dict], assistant_turn: str):
        """A tool call → its result as the next user message (reward −call_cost, not done);
        anything else → the answer, scored (done)."""
        call = parse_tool_call(assistant_turn)
        if call is not None:
            return self.run_tool(call), -self.call_cost, False, {"tool_call": 1}
        score = self.verifier.score(assistant_turn, self.problem)
        return None, score, True, {"success": float(score == 1.0)}
