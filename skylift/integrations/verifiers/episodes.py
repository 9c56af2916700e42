"""verifiers episodes as skylift trajectories: exactly the token ids and logprobs the env server
sampled, with the trace's reward.

An episode (``verifiers.v1.episode.Episode``, as its env server sends it) holds one trace per
agent run. A trace is a message graph: each node carries the token ids it adds to the sequence
(``token_ids``), which of them the model sampled (``mask``) and their sampling logprobs
(``logprobs``, one per sampled token); a root-to-leaf path is one context the model saw. Each
trainable path of a trainable agent's trace becomes one `Trajectory`: its ids up to the first
sampled token are the prompt, the rest the response (``loss_mask`` from the mask, so tool results
and user turns in between are not trained on), its reward the trace's (the sum of its weighted
rewards). A path that is a dropped compaction attempt is skipped, as verifiers does.

An episode that failed (``ok`` not true, or a trace's ``ok`` false) raises `EpisodeFailed` with the
server's errors; one whose nodes carry no token ids (sampled with verifiers' ``eval`` client)
or whose lengths disagree raises `MalformedEpisode`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from skylift.generator.rollout_errors import PromptTooLongError
from skylift.generator.trajectory import Trajectory
from skylift.integrations.verifiers.wire import MalformedEpisode

#: stop conditions verifiers counts as truncation (``Trace.is_truncated``)
TRUNCATING_STOPS = frozenset(
    {"max_turns", "max_input_tokens", "max_output_tokens", "max_total_tokens", "compaction_failed"}
)


class EpisodeFailed(RuntimeError):
    """The env server ran the episode, and it failed (its errors are in the message)."""


def _errors(errors: Any) -> str:
    if not isinstance(errors, list) or not errors:
        return "no error recorded"
    parts = []
    for error in errors[-3:]:
        if isinstance(error, dict):
            parts.append(f"{error.get('type', 'Error')}: {error.get('message', '')}".strip())
        else:
            parts.append(str(error))
    return "; ".join(parts)


def _int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise MalformedEpisode(f"{what} must be a list of integers")
    return value


def trace_reward(trace: dict[str, Any]) -> float:
    """The sum of the trace's rewards, each ``score * weight`` (a reward that did not run: 0)."""
    rewards = trace.get("rewards") or {}
    if not isinstance(rewards, dict):
        raise MalformedEpisode(f"trace {trace.get('id')}: 'rewards' must be a mapping")
    total = 0.0
    for name, reward in rewards.items():
        if reward is None:
            continue
        if not isinstance(reward, dict) or not isinstance(reward.get("score"), int | float):
            raise MalformedEpisode(f"trace {trace.get('id')}: reward {name!r} has no numeric 'score'")
        total += float(reward["score"]) * float(reward.get("weight", 1.0))
    return total


def _paths(trace_id: str, nodes: list[dict[str, Any]]) -> list[list[int]]:
    """The trainable root-to-leaf node paths of a trace's graph, leaves in node order."""
    parents: list[int | None] = []
    for index, node in enumerate(nodes):
        parent = node.get("parent")
        if parent is not None and not (isinstance(parent, int) and 0 <= parent < index):
            raise MalformedEpisode(
                f"trace {trace_id}: node {index} has parent {parent!r}, not an earlier node"
            )
        parents.append(parent)
    has_child = {p for p in parents if p is not None}
    accepted = {
        link.get("node")
        for node in nodes
        for link in node.get("semantic_parents") or []
        if isinstance(link, dict) and link.get("type") == "compaction"
    }
    paths = []
    for leaf in range(len(nodes)):
        if leaf in has_child:
            continue
        links = nodes[leaf].get("semantic_parents") or []
        if any(isinstance(link, dict) and link.get("type") == "compaction_attempt" for link in links):
            if leaf not in accepted:
                continue
        path: list[int] = []
        at: int | None = leaf
        while at is not None:
            path.append(at)
            at = parents[at]
        paths.append(path[::-1])
    return paths


def _path_sample(
    trace_id: str, nodes: list[dict[str, Any]], path: list[int]
) -> tuple[list[int], list[int], list[float], int, str]:
    """(token ids, loss mask, logprobs spread over the ids, sampled turns, sampled text) of a path."""
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    turns = 0
    texts: list[str] = []
    for index in path:
        node = nodes[index]
        where = f"trace {trace_id}, node {index}"
        node_ids = _int_list(node.get("token_ids", []), f"{where}: 'token_ids'")
        node_mask = node.get("mask") or []
        if not isinstance(node_mask, list) or len(node_mask) != len(node_ids):
            raise MalformedEpisode(
                f"{where}: 'mask' has {len(node_mask)} entries for {len(node_ids)} token ids"
            )
        node_logprobs = node.get("logprobs") or []
        sampled = sum(1 for m in node_mask if m)
        if not isinstance(node_logprobs, list) or len(node_logprobs) != sampled:
            raise MalformedEpisode(
                f"{where}: {len(node_logprobs) if isinstance(node_logprobs, list) else 'no'} logprobs "
                f"for {sampled} sampled tokens"
            )
        if node.get("sampled"):
            if not node_ids:
                raise MalformedEpisode(
                    f"{where}: a sampled turn without token ids (the env server must sample with "
                    "verifiers' 'train' client, which skylift asks for: is the request's client "
                    "overridden?)"
                )
            turns += 1
            message = node.get("message") or {}
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                texts.append(content)
        it = iter(node_logprobs)
        for token, m in zip(node_ids, node_mask, strict=True):
            ids.append(token)
            mask.append(1 if m else 0)
            logprobs.append(float(next(it)) if m else 0.0)
    return ids, mask, logprobs, turns, "\n".join(texts)


def episode_trajectories(
    episode: dict[str, Any],
    uid: str,
    *,
    data_source: str = "",
    policy_version: int = 0,
    max_prompt_length: int | None = None,
    zero_reward_on_non_stop: bool = False,
    apply_overlong_filtering: bool = False,
) -> list[Trajectory]:
    """The trajectories of one episode of prompt `uid` (see the module docstring)."""
    if not isinstance(episode, dict):
        raise MalformedEpisode(f"an episode must be a mapping, got {type(episode).__name__}")
    episode_id = str(episode.get("id", "?"))
    traces = episode.get("traces")
    if not isinstance(traces, list):
        raise MalformedEpisode(f"episode {episode_id}: 'traces' must be a list")
    # `ok` is the verdict; `errors` also keeps those of earlier attempts of a retried episode
    failed = [t for t in traces if isinstance(t, dict) and t.get("ok") is False]
    if episode.get("ok") is not True or failed:
        errors = episode.get("errors") or (failed[0].get("errors") if failed else None)
        raise EpisodeFailed(f"verifiers episode {episode_id} of prompt {uid} failed: {_errors(errors)}")
    out: list[Trajectory] = []
    for trace in traces:
        if not isinstance(trace, dict):
            raise MalformedEpisode(f"episode {episode_id}: a trace is not a mapping")
        trace_id = str(trace.get("id", "?"))
        agent = trace.get("agent") or {}
        if isinstance(agent, dict) and agent.get("trainable") is False:
            continue
        nodes = trace.get("nodes")
        if not isinstance(nodes, list) or not all(isinstance(n, dict) for n in nodes):
            raise MalformedEpisode(f"trace {trace_id}: 'nodes' must be a list of mappings")
        reward = trace_reward(trace)
        truncated = trace.get("stop_condition") in TRUNCATING_STOPS or _last_finish(trace) == "length"
        metrics = {
            str(name): float(value)
            for name, value in (trace.get("metrics") or {}).items()
            if isinstance(value, int | float) and not isinstance(value, bool)
        }
        for path in _paths(trace_id, nodes):
            ids, mask, logprobs, turns, text = _path_sample(trace_id, nodes, path)
            if 1 not in mask:
                continue  # a path the model never sampled on (e.g. a prompt-only branch)
            start = mask.index(1)
            if start == 0:
                raise MalformedEpisode(f"trace {trace_id}: a path starts with sampled tokens (no prompt)")
            if max_prompt_length is not None and start > max_prompt_length:
                raise PromptTooLongError(
                    f"verifiers episode {episode_id} of prompt {uid}: the prompt has {start} tokens, more "
                    f"than trainer.max_prompt_length={max_prompt_length}"
                )
            loss_mask = mask[start:]
            tr_reward = reward
            if truncated:
                if zero_reward_on_non_stop:
                    tr_reward = 0.0
                if apply_overlong_filtering:
                    loss_mask = [0] * len(loss_mask)
            out.append(
                Trajectory(
                    uid=uid,
                    prompt_ids=ids[:start],
                    response_ids=ids[start:],
                    loss_mask=loss_mask,
                    rollout_logprobs=logprobs[start:],
                    reward=tr_reward,
                    stop_reason="length" if truncated else "stop",
                    data_source=data_source,
                    num_turns=turns,
                    policy_version=policy_version,
                    env_metadata={
                        "verifiers_episode": episode_id,
                        "verifiers_trace": trace_id,
                        "stop_condition": trace.get("stop_condition"),
                    },
                    response_text=text,
                    metrics=dict(metrics),
                )
            )
    if not out:
        raise MalformedEpisode(
            f"verifiers episode {episode_id} of prompt {uid} has no trainable sampled tokens"
        )
    return out


def _last_finish(trace: dict[str, Any]) -> str | None:
    calls: Sequence[Any] = trace.get("calls") or []
    for call in reversed(calls):
        if isinstance(call, dict) and call.get("error") is None:
            reason = call.get("finish_reason")
            return reason if isinstance(reason, str) else None
    return None
