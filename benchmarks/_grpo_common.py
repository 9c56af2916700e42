"""What both sides of `grpo_step_vs_trl.py` share: the model, the prompts, the TRL-style reward
function, the reward agreement check and the step and memory probes.

Benchmarks run as `python benchmarks/NAME.py`, so this module is importable as `_grpo_common`.
"""

from __future__ import annotations

import os
import re
import threading
import time
from typing import Any

MODEL = "smollm2-135m-instruct"


# ---- the TRL-style reward function (independent implementation of the gsm8k rule) --------------

_HASH_ANSWER = re.compile(r"####\s*(-?\$?[\d,]*\.?\d+)")


def _to_number(text: str) -> float | None:
    cleaned = text.replace(",", "").replace("$", "").strip()
    try:
        return float(cleaned)
    except ValueError:
        return None


def hash_answer_reward(completions: list[Any], ground_truth: list[str], **kwargs: Any) -> list[float]:
    """A reward function in TRL's calling convention: 1.0 when the number after the last
    ``#### number`` of a completion equals its ``ground_truth`` (``,`` and ``$`` ignored), else 0.0.
    `completions` are strings or conversational ``[{"role": "assistant", "content": ...}]`` lists."""
    rewards: list[float] = []
    for completion, truth in zip(completions, ground_truth, strict=True):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        answers = [n for n in (_to_number(m) for m in _HASH_ANSWER.findall(text)) if n is not None]
        expected = _to_number(str(truth))
        rewards.append(1.0 if answers and expected is not None and answers[-1] == expected else 0.0)
    return rewards


def train_rows(num_prompts: int) -> list[dict[str, Any]]:
    from skylift.data import make_addition_demo_splits

    train, _ = make_addition_demo_splits(num_prompts, num_heldout=8, seed=0)
    return train


def tree_cpu_s() -> float:
    """User + system CPU seconds used so far by this process and its live descendants."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


class StepProbe:
    """Wall clock, load average and process-tree CPU seconds at the start and end of each step
    (marked in pairs); the last pair is the timed step."""

    def __init__(self) -> None:
        self.window: list[float] = []
        self.cpu: list[float] = []
        self.load: list[float] = []

    def mark(self) -> None:
        self.window.append(time.time())
        self.cpu.append(tree_cpu_s())
        self.load.append(os.getloadavg()[0])

    def summary(self) -> dict[str, Any]:
        if len(self.cpu) < 2 or len(self.cpu) % 2:
            raise RuntimeError(f"step probe marked {len(self.cpu)} times, expected pairs")
        return {
            "window": self.window[-2:],
            "cpu_s": self.cpu[-1] - self.cpu[-2],
            "loadavg_1min": self.load[-2:],
            "warmup_cpu_s": [self.cpu[i + 1] - self.cpu[i] for i in range(0, len(self.cpu) - 2, 2)],
        }


class TreeMemorySampler:
    """Samples the summed RSS of a process and its descendants every `interval_s`, and their
    summed PSS every `pss_every`-th sample and whenever the summed RSS reaches a new high.

    Summed RSS counts pages shared between processes (libraries, torch) once per process, which
    inflates many-process trees such as Ray + vLLM; summed PSS splits shared pages between them.
    PSS comes from /proc/PID/smaps_rollup, whose page walk costs ~20-50 ms of CPU per GB-sized
    process: read at every 0.5 s sample it took ~0.1-0.3 of a core from the 2-core machine that
    the measured side runs on (RSS, from /proc/PID/statm, costs ~0.03 ms)."""

    def __init__(self, pid: int, interval_s: float = 0.5, pss_every: int = 4) -> None:
        import psutil

        self._root = psutil.Process(pid)
        self._interval = interval_s
        self._pss_every = pss_every
        self.samples: list[tuple[float, int, int | None]] = []  # (epoch s, summed RSS, summed PSS)
        self.seen: dict[int, Any] = {}  # pid -> psutil.Process of every descendant ever sampled
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self, count: int, peak_rss: int) -> tuple[int, int | None]:
        import psutil

        try:
            procs = [self._root, *self._root.children(recursive=True)]
        except psutil.Error:
            return 0, None
        rss = 0
        for proc in procs:
            self.seen.setdefault(proc.pid, proc)
            try:
                rss += proc.memory_info().rss
            except psutil.Error:
                pass
        if count % self._pss_every and rss <= peak_rss * 1.005:
            return rss, None
        pss = 0
        for proc in procs:
            try:
                info = proc.memory_full_info()
                pss += getattr(info, "pss", info.rss)
            except psutil.Error:
                pass
        return rss, pss

    def _run(self) -> None:
        peak_rss = 0
        while not self._stop.is_set():
            rss, pss = self._sample(len(self.samples), peak_rss)
            peak_rss = max(peak_rss, rss)
            self.samples.append((time.time(), rss, pss))
            self._stop.wait(self._interval)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def reap_leftovers(self, grace_s: float = 30.0) -> list[str]:
        """Wait up to `grace_s` for every process this tree ever had to exit; terminate (by pid) the
        ones that outlive it, so that they do not load the other side's run. Returns their names."""
        import psutil

        alive = [p for p in self.seen.values() if p.is_running()]
        _, alive = psutil.wait_procs(alive, timeout=grace_s)
        names = []
        for proc in alive:
            try:
                names.append(f"{proc.pid}:{proc.name()}")
                proc.terminate()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=10)
        return names

    def peak(self, start: float | None = None, end: float | None = None, pss: bool = False) -> int:
        """Peak summed RSS (or PSS) over all samples, or over those taken between `start` and `end`
        (epoch seconds)."""
        values = [
            (p if pss else r)
            for t, r, p in self.samples
            if (start is None or t >= start) and (end is None or t <= end)
        ]
        return max((v for v in values if v is not None), default=0)


# ---- reward agreement -------------------------------------------------------------------------


def check_agreement(
    skylift_side: dict[str, Any], trl_side: dict[str, Any], key: str = "completions"
) -> dict[str, Any]:
    """Score each side's completions (those of the timed step; `key="warmup_completions"`: the
    warm-up steps') with the other side's reward function and compare."""
    from skylift.envs import gsm8k_reward, make_env

    def skylift_env_reward(text: str, truth: str) -> float:
        env = make_env("arithmetic")
        env.init(
            [{"role": "user", "content": "?"}], {"reward_spec": {"method": "rule", "ground_truth": truth}}
        )
        reward = float(env.step(text).reward)
        env.close()
        return reward

    mismatches: list[dict[str, Any]] = []
    trl_done = trl_side[key]
    trl_agree = 0
    for c in trl_done:
        env_r = skylift_env_reward(c["text"], c["ground_truth"])
        fn_r = gsm8k_reward(c["text"], c["ground_truth"])
        if env_r == fn_r == c["reward"]:
            trl_agree += 1
        else:
            mismatches.append({"side": "trl", **c, "skylift_env": env_r, "gsm8k_reward": fn_r})
    sky_done = skylift_side[key]
    sky_agree = 0
    for c in sky_done:
        trl_r = hash_answer_reward([c["text"]], [c["ground_truth"]])[0]
        if trl_r == c["reward"]:
            sky_agree += 1
        else:
            mismatches.append({"side": "skylift", **c, "trl_style": trl_r})
    return {
        "trl_completions_scored_by_skylift": f"{trl_agree}/{len(trl_done)}",
        "skylift_completions_scored_by_trl_style": f"{sky_agree}/{len(sky_done)}",
        "rewards_agree": not mismatches and len(trl_done) == len(sky_done),
        "trl_correct": sum(c["reward"] for c in trl_done),
        "skylift_correct": sum(c["reward"] for c in sky_done),
        "mismatches": mismatches,
    }
