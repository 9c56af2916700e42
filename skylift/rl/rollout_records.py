"""What a run records for `skylift view` (`trainer.rollout_records.*`) and the trackers' sample tables.

Every `interval` training steps the first `groups_per_step` prompt groups of the step's batch are
written to ``<log_dir>/rollouts/train_step_<N>.json`` (N: the 1-based step, as in metrics.jsonl
and the batch dump), and after every evaluation (at the same interval) the first `eval_prompts`
prompts to ``eval_step_<N>.json``. One file is one JSON object::

    {"kind": "train" | "eval", "step": N, "groups": [
        {"uid", "data_source", "env_class", "messages": [{"role", "content"}] | null,
         "prompt_text", "samples": [
            {"reward", "advantage", "stop_reason", "length", "num_turns", "policy_version",
             "turn_rewards", "metrics", "correct" (evaluations), "mean_abs_diff", "max_abs_diff",
             "segments": [{"role": "assistant" | "tool" | "observation", "text", "tool_call",
                           "tokens": [text, ...] (assistant), "diff": [float, ...] | null}]}]}]}

A segment is a run of response tokens with the same loss mask: the policy's sampled tokens
(assistant), or what the environment added between turns (a tool's result, an observation). `diff`
is the trainer's logprob minus the engine's per sampled token: the experience's PPO anchor (the
tensors the batch dump, `skylift.rl.batch_dump.batch_record`, writes) when the trainer computed it,
else (every `logprob_interval`-th step) one forward pass of the recorded rows alone, else null.
When the folder reaches `max_mb` the run stops recording and says so. The trackers get
`tracker_rows` of each record's samples as a table (`table_rows`; `Tracking.log_samples`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from skylift.algorithms.sample_support import Sampling
from skylift.config.records import RolloutRecordsConfig
from skylift.config.schema import SkyliftConfig
from skylift.generator import Trajectory
from skylift.generator.vision import printable_messages
from skylift.rl.batch_dump import batch_record
from skylift.rl.experience import Experience
from skylift.rl.parts import Parts
from skylift.rl.update import pad_rows
from skylift.worker.batch import SequenceBatch

logger = logging.getLogger(__name__)

RECORDS_DIR = "rollouts"
MAX_PROMPT_INDEX = 200_000  # larger datasets: the rendered prompt only (no message lookup)
_TOOL_CALL = re.compile(r"<tool_call>|<tool name=|<function=|\[TOOL_CALLS\]|<\|python_tag\|>")
_TOOL_RESULT = re.compile(r"<tool_response>|<\|im_start\|>tool|ipython<\|end_header_id\|>|\"role\": \"tool\"")


def record_path(logs_dir: Path, kind: str, step: int) -> Path:
    return logs_dir / RECORDS_DIR / f"{kind}_step_{step}.json"


class RolloutRecorder:
    """Writes the records of chosen steps and evaluations; `decode` turns token ids into text."""

    def __init__(
        self,
        cfg: RolloutRecordsConfig,
        logs_dir: Path,
        decode: Callable[[list[int]], str] | None,
        prompts: Callable[[], dict[str, list[dict[str, Any]]]] | None = None,
        tracking: Any = None,
        say: Callable[[str], None] | None = None,
        trainer_logprobs: Callable[[SequenceBatch], Tensor] | None = None,
    ) -> None:
        """`trainer_logprobs`: the policy's logprobs of a batch's response tokens (`[B, R]`), for
        steps whose experience has none of its own (one on-policy update: no PPO anchor pass)."""
        self.cfg, self.logs_dir, self.decode = cfg, logs_dir, decode
        self.trainer_logprobs = trainer_logprobs
        self._prompts_source = prompts
        self._prompts: dict[str, list[dict[str, Any]]] | None = None  # uid -> messages, on first use
        self._log_samples = getattr(tracking, "log_samples", None)
        self._say = say or (lambda text: None)
        self._token_text: dict[int, str] = {}
        self._written = _folder_bytes(logs_dir / RECORDS_DIR)
        self._full = False

    @classmethod
    def from_parts(
        cls, cfg: SkyliftConfig, parts: Parts, sampling: Sampling, say: Callable[[str], None]
    ) -> RolloutRecorder:
        """The recorder of a run (`trainer.rollout_records`) over its parts; the policy's logprobs
        are taken under `sampling`, the trainer's distribution (`UpdateSettings.temperature`)."""
        forward_rows = cfg.trainer.micro_forward_batch_size_per_gpu

        def trainer_logprobs(batch: SequenceBatch) -> Tensor:
            padded = pad_rows(batch, parts.policy.world_size)  # every rank gets rows
            return parts.policy.compute_logprobs(padded, forward_rows, sampling)

        def prompts() -> dict[str, list[dict[str, Any]]]:
            index: dict[str, list[dict[str, Any]]] = {}
            for data in (parts.train_data, parts.val_data or []):
                if len(data) <= MAX_PROMPT_INDEX:
                    index.update((row.uid, row.prompt) for row in (data[i] for i in range(len(data))))
            return index

        records = cfg.trainer.rollout_records
        return cls(records, parts.logs_dir, parts.decode, prompts, parts.tracking, say, trainer_logprobs)

    def _on(self) -> bool:
        return self.cfg.interval > 0 and self.decode is not None and not self._full

    # ---------------------------------------------------------------- training steps
    def step(self, step: int, experience: Experience, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """Record training step `step` (1-based) if it is due; its cost as `timing/rollout_records_s`."""
        if not self._on() or step % self.cfg.interval:
            return {}
        tick = time.perf_counter()
        record = batch_record(experience, trajectories)
        extras, mask = record["extras"], record["response_mask"]
        chosen = _groups(trajectories, self.cfg.groups_per_step)
        diffs = self._diffs(experience, [i for _, rows in chosen for i in rows], step)
        advantages = extras.get("advantages")
        groups: list[dict[str, Any]] = []
        for uid, rows in chosen:
            samples = []
            for i in rows:
                tr, n = trajectories[i], len(trajectories[i].response_ids)
                adv = None
                if advantages is not None and float(mask[i].sum()) > 0:
                    adv = float((advantages[i] * mask[i]).sum() / mask[i].sum())
                samples.append(self._sample(tr, adv, diffs[i][:n] if i in diffs else None))
            groups.append(self._group(uid, trajectories[rows[0]], samples))
        self._write(
            record_path(self.logs_dir, "train", step), {"kind": "train", "step": step, "groups": groups}
        )
        self._to_trackers("train", step, groups)
        return {"timing/rollout_records_s": time.perf_counter() - tick}

    def _diffs(self, experience: Experience, rows: list[int], step: int) -> dict[int, list[float]]:
        """Per row of `rows`, the trainer's logprob minus the engine's per response token: the
        experience's PPO anchor when the trainer computed it, else (every `logprob_interval`-th
        step: it costs a forward pass) one forward pass of the recorded rows; {} otherwise."""
        batch = experience.batch
        if "policy/logprob_diff_vs_rollout" in experience.metrics and "old_logprobs" in batch.extras:
            gap = batch.extras["old_logprobs"] - batch.extras["rollout_logprobs"]
            return {i: gap[i].tolist() for i in rows}
        every = self.cfg.logprob_interval
        if self.trainer_logprobs is None or not rows or every <= 0 or (step - 1) % every:
            return {}
        sub = batch.select(rows)
        gap = self.trainer_logprobs(sub)[: len(rows)] - sub.extras["rollout_logprobs"]
        return {i: gap[k].tolist() for k, i in enumerate(rows)}

    # ---------------------------------------------------------------- evaluations
    def evaluation(self, step: int, trajectories: Sequence[Trajectory]) -> None:
        """Record the evaluation run after step `step` (0: before training)."""
        if not self._on() or self.cfg.eval_prompts <= 0 or not trajectories:
            return
        groups = []
        for uid, rows in _groups(trajectories, self.cfg.eval_prompts):
            samples = [
                {**self._sample(trajectories[i], None, None), "correct": trajectories[i].reward > 0}
                for i in rows
            ]
            groups.append(self._group(uid, trajectories[rows[0]], samples))
        self._write(
            record_path(self.logs_dir, "eval", step), {"kind": "eval", "step": step, "groups": groups}
        )
        self._to_trackers("eval", step, groups)

    # ---------------------------------------------------------------- pieces
    def _group(self, uid: str, first: Trajectory, samples: list[dict[str, Any]]) -> dict[str, Any]:
        if self._prompts is None:
            self._prompts = self._prompts_source() if self._prompts_source is not None else {}
        assert self.decode is not None
        return {
            "uid": uid,
            "data_source": first.data_source,
            "env_class": first.env_class,
            "messages": printable_messages(self._prompts.get(uid)),
            "prompt_text": self.decode(list(first.prompt_ids)),
            "samples": samples,
        }

    def _sample(self, tr: Trajectory, advantage: float | None, diff: list[float] | None) -> dict[str, Any]:
        segments = self._segments(tr, diff)
        sampled = [abs(d) for s in segments for d in (s["diff"] or [])]
        return {
            "reward": float(tr.reward),
            "advantage": advantage,
            "stop_reason": tr.stop_reason,
            "length": tr.num_generated_tokens,
            "num_turns": tr.num_turns,
            "policy_version": tr.policy_version,
            "turn_rewards": [list(t) for t in tr.turn_rewards],
            "metrics": dict(tr.metrics),
            "mean_abs_diff": sum(sampled) / len(sampled) if sampled else None,
            "max_abs_diff": max(sampled) if sampled else None,
            "segments": segments,
        }

    def _segments(self, tr: Trajectory, diff: list[float] | None) -> list[dict[str, Any]]:
        """The response as runs of equal loss mask: sampled tokens one by one, observations whole."""
        assert self.decode is not None
        out: list[dict[str, Any]] = []
        ids, mask, start = tr.response_ids, tr.loss_mask, 0
        for end in range(1, len(ids) + 1):
            if end < len(ids) and mask[end] == mask[start]:
                continue
            if mask[start]:
                tokens = [self._token(t) for t in ids[start:end]]
                text = "".join(tokens)
                part = diff[start:end] if diff is not None else None
                out.append(
                    {
                        "role": "assistant",
                        "text": text,
                        "tool_call": bool(_TOOL_CALL.search(text)),
                        "tokens": tokens,
                        "diff": [round(d, 4) for d in part] if part is not None else None,
                    }
                )
            else:
                text = self.decode(list(ids[start:end]))
                role = "tool" if _TOOL_RESULT.search(text) else "observation"
                out.append({"role": role, "text": text, "tool_call": False, "tokens": None, "diff": None})
            start = end
        return out

    def _token(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            assert self.decode is not None
            text = self._token_text[token_id] = self.decode([token_id])
        return text

    def _write(self, path: Path, record: dict[str, Any]) -> None:
        data = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()
        if self._written + len(data) > self.cfg.max_mb * 2**20:
            self._full = True
            self._say(
                f"rollout records reached trainer.rollout_records.max_mb={self.cfg.max_mb:g} in "
                f"{path.parent}: recording stops"
            )
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        self._written += len(data)

    def _to_trackers(self, kind: str, step: int, groups: list[dict[str, Any]]) -> None:
        if self._log_samples is None or self.cfg.tracker_rows <= 0:
            return
        rows = table_rows(kind, step, groups)[: self.cfg.tracker_rows]
        try:
            self._log_samples(rows, step, f"samples/{kind}")
        except Exception as exc:  # a tracker's table must not end the run
            logger.warning("a tracker refused the %s sample table of step %d: %s", kind, step, exc)


def table_rows(kind: str, step: int, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One flat row per sample: what the trackers' tables show (`skylift.tracking`)."""
    rows = []
    for group in groups:
        messages = group["messages"] or []
        prompt = next((m["content"] for m in reversed(messages) if m.get("role") == "user"), None)
        for j, sample in enumerate(group["samples"]):
            rows.append(
                {
                    "kind": kind,
                    "step": step,
                    "uid": group["uid"],
                    "sample": j,
                    "prompt": str(prompt if prompt is not None else group["prompt_text"]),
                    "response": "".join(s["text"] for s in sample["segments"]),
                    "reward": sample["reward"],
                    "advantage": sample["advantage"],
                    "stop_reason": sample["stop_reason"],
                    "length": sample["length"],
                }
            )
    return rows


def _groups(trajectories: Sequence[Trajectory], count: int) -> list[tuple[str, list[int]]]:
    """The first `count` prompt groups (by uid, in batch order) with their rows."""
    order: dict[str, list[int]] = {}
    for i, tr in enumerate(trajectories):
        if tr.uid not in order and len(order) >= count:
            continue
        order.setdefault(tr.uid, []).append(i)
    return list(order.items())


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.json")) if folder.is_dir() else 0
