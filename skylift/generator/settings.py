"""What the generator is configured with (`GeneratorSettings`), built from the run's config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the config (omegaconf) stays out of the generator's imports: the GPU check
    from skylift.config.schema import SkyliftConfig  # runs the trajectory code without it


def max_generate_length(cfg: SkyliftConfig) -> int:
    """A rollout's response budget in tokens: `generator.max_generate_length`, else
    `generator.sampling_params.max_generate_length`."""
    g = cfg.generator
    return int(g.max_generate_length or g.sampling_params.max_generate_length)


@dataclass
class GeneratorSettings:
    max_prompt_length: int = 512
    max_generate_length: int = 256
    max_turns: int = 1
    max_input_length: int | None = None  # multi-turn context cap; None = prompt + generate length
    zero_reward_on_non_stop: bool = False
    apply_overlong_filtering: bool = False
    env_kwargs: dict[str, Any] | None = None
    default_env_class: str = "gsm8k"
    batched: bool = True  # single-turn: one request for the batch (False: the agent loop per trajectory)
    conversation_multi_turn: bool = True  # observations as chat messages (False: as plain text)
    env_workers: int = 0  # threads for plain (not async) env.init/step/close; 0 = call them inline
    #: a sample the engine aborted (a weight update with pause mode "abort") is resubmitted: its
    #: prompt plus the tokens sampled so far, for the tokens left (at most `MAX_RESUBMITS` times)
    resubmit_aborted: bool = False
    #: label trajectories with the engines' per-token weight versions (fully async training, where
    #: the engines are told each version); False: with the caller's `policy_version` (an engine's
    #: labels may be left from another run or client of a shared server)
    engine_versions: bool = False
    # agentic rollouts (issue 31)
    chat_template_kwargs: dict[str, Any] | None = None  # passed to every apply_chat_template
    #: multi-turn: after a turn that ended on a stop string (or was truncated) and goes on, add the
    #: template's turn-closing tokens (EOS) as untrained tokens; False: the observation follows directly
    append_eos_after_stop_str: bool = True
    #: multi-turn: each turn its own sample (prompt: the context sent for it), sharing the rollout's
    #: advantage (`skylift.generator.step_wise`), for templates that rewrite earlier turns
    step_wise: bool = False
    #: step-wise: merge a rollout's consecutive steps when one's prompt + response starts the next's
    #: prompt (`skylift.generator.step_wise.merge_steps`; `generator.merge_stepwise_output`)
    merge_steps: bool = False
    #: multi-turn: what a rollout does when the chat template (or a token-level environment)
    #: renders its conversation differently than the trajectory holds it: "error" stops with the
    #: reason, "step_wise" makes that rollout's turns step-wise samples from then on
    on_template_mismatch: str = "error"
    llm_base_url: str | None = None  # environments' `llm`: this OpenAI-compatible URL, None = the policy
    llm_model: str = "default"  # the model name sent to llm_base_url
    llm_timeout_s: float = 60.0  # per call of an environment's `llm`
    tool_timeout_s: float = 10.0  # per tool call
    max_concurrent_tool_calls: int = 8  # tool calls running at once (all trajectories)
    #: routing replay (`generator.enable_return_routed_experts`): every sample must come with the
    #: engine's routed experts, which the trajectory keeps aligned with its ids (`generator.routed`)
    routed_experts: bool = False


#: The most times one sample is resubmitted after an abort before it is kept as aborted.
MAX_RESUBMITS = 32

#: Seed offset between the turns of one multi-turn trajectory (samples of a row are 1 apart).
TURN_SEED_STRIDE = 1_000_003
