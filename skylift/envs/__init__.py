"""Environments that score the policy's responses: interface, registry and built-ins.

Built-ins: ``gsm8k``, ``arithmetic`` (single turn) and ``arithmetic_multiturn`` (one retry with
feedback). See `skylift.envs.base` for the protocol and `skylift.envs.rewards` for the answer rule;
`skylift.envs.tools` for tool-calling environments, `skylift.envs.llm` for calling a model.
"""

from skylift.envs.arithmetic import RETRY_FEEDBACK, ArithmeticEnv, ArithmeticMultiTurnEnv
from skylift.envs.base import Environment, EnvUsageError, Message, StepResult
from skylift.envs.final_answer import FinalAnswerEnv, ground_truth_from
from skylift.envs.gsm8k import GSM8KEnv
from skylift.envs.registry import (
    UnknownEnvironmentError,
    get_env_factory,
    list_envs,
    make_env,
    register_env,
    unregister_env,
)
from skylift.envs.rewards import (
    ParsedAnswer,
    answers_equal,
    extract_final_answer,
    gsm8k_reward,
    normalize_number,
    parse_final_answer,
)
from skylift.envs.tools import Tool, ToolEnvironment, ToolRunner

__all__ = [
    "RETRY_FEEDBACK",
    "ArithmeticEnv",
    "ArithmeticMultiTurnEnv",
    "EnvUsageError",
    "Environment",
    "FinalAnswerEnv",
    "GSM8KEnv",
    "Message",
    "ParsedAnswer",
    "StepResult",
    "Tool",
    "ToolEnvironment",
    "ToolRunner",
    "UnknownEnvironmentError",
    "answers_equal",
    "extract_final_answer",
    "get_env_factory",
    "ground_truth_from",
    "gsm8k_reward",
    "list_envs",
    "make_env",
    "normalize_number",
    "parse_final_answer",
    "register_env",
    "unregister_env",
]
