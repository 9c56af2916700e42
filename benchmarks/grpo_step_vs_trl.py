"""One GRPO step in skylift against one in TRL's `GRPOTrainer`, side by side on this CPU.

Both sides train the same model (SmolLM2-135M-Instruct, fp32, from `skylift.models`) on the same
batch: the first `--num-prompts` (8) prompts of the addition demo (a chat with a worked example,
see `skylift.data.synthetic`), `--group-size` (4) sampled completions per prompt, at most
`--max-new-tokens` (64) new tokens, temperature 1, no KL term, GRPO advantages with std
normalisation, token-mean loss, lr `--lr` (5e-6), one optimizer step.

- skylift: `RLTrainer` from the config API with the demo's float32 settings (the demo's bf16
  engine and mixed precision, used where the CPU has bf16 matrix instructions, are left out: both
  sides compute in float32), vLLM engine, policy worker, weight sync to the engine after the step.
  `setup()` (engine start-up, model load) is not timed; the step is `timing/step_s` of `fit()`
  with `trainer.max_steps=1`. skylift runs twice, each in a child of its own: with every row
  trained (`trainer.skip_zero_advantage_rows=false`: the figure that does not depend on how many
  groups of the batch carry a reward signal; the JSON `ratio`) and with the default settings
  (rows whose advantages are all zero are skipped, exactly the same update; `ratio_default`).
- TRL: `GRPOTrainer` (HF generate, gradient checkpointing on, fp32, `use_cpu=True`) with one
  optimizer step per 8 x 4 completions. Building the trainer (model load) is not timed; the step
  is the time from the `on_step_begin` to the `on_step_end` callback of `train()` with
  `max_steps=1` (generation, rewards, forward, backward, optimizer step).

Each run has its own child process, one after the other, so that their memory can be
measured apart (peak summed RSS of the child's process tree, sampled every 0.25 s; shared pages
count once per process, so the Ray/vLLM side is over-counted rather than under-counted).

Reward agreement: TRL's completions are scored again with skylift's ``arithmetic`` environment
and `skylift.envs.gsm8k_reward`; skylift's completions are scored with a TRL-style reward function
(`hash_answer_reward`, written here independently of skylift's parser) that implements the same
rule. Every pair must agree, otherwise the script exits with status 1 after printing the summary.

Run (skylift starts Ray and vLLM, which must stay on a loopback-only network):
    unshare -n sh -c 'ip link set lo up; .venv/bin/python benchmarks/grpo_step_vs_trl.py'

Needs TRL in the environment (``pip install trl==1.16.0``; it brings datasets). The last stdout
line is one JSON object: {"ratio": skylift_step_s / trl_step_s (every row trained),
"ratio_default": skylift_default_step_s / trl_step_s, "skylift_step_s", "trl_step_s", ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

for _key, _value in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "GLOO_SOCKET_IFNAME": "lo",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_DISABLED": "true",
}.items():
    os.environ.setdefault(_key, _value)

MODEL = "smollm2-135m-instruct"
#: skylift's two runs: every row trained (the headline `ratio`) and the default settings
SKY_RUNS = ("skylift", "skylift-default")
CHILD_TIMEOUT_S = 1800.0


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


# ---- shared helpers ---------------------------------------------------------------------------


def _write_data(out_dir: Path, num_prompts: int) -> Path:
    """Write the demo's parquet files with `num_prompts` train prompts; returns train.parquet."""
    from skylift.data import write_addition_demo

    write_addition_demo(out_dir, num_train=num_prompts, num_val=8, seed=0)
    return out_dir / "train.parquet"


def _train_rows(num_prompts: int) -> list[dict[str, Any]]:
    from skylift.data import make_addition_demo_splits

    train, _ = make_addition_demo_splits(num_prompts, num_heldout=8, seed=0)
    return train


def _tree_cpu_s() -> float:
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
    """Wall clock, load average and process-tree CPU seconds at the start and end of a step."""

    def __init__(self) -> None:
        self.window: list[float] = []
        self.cpu: list[float] = []
        self.load: list[float] = []

    def mark(self) -> None:
        self.window.append(time.time())
        self.cpu.append(_tree_cpu_s())
        self.load.append(os.getloadavg()[0])

    def summary(self) -> dict[str, Any]:
        return {
            "window": self.window[:2],
            "cpu_s": self.cpu[1] - self.cpu[0],
            "loadavg_1min": self.load[:2],
        }


class TreeMemorySampler:
    """Samples the summed RSS and PSS of a process and its descendants every `interval_s`.

    Summed RSS counts pages shared between processes (libraries, torch) once per process, which
    inflates many-process trees such as Ray + vLLM; summed PSS splits shared pages between them."""

    def __init__(self, pid: int, interval_s: float = 0.5) -> None:
        import psutil

        self._root = psutil.Process(pid)
        self._interval = interval_s
        self.samples: list[tuple[float, int, int]] = []  # (epoch s, summed RSS, summed PSS)
        self.seen: dict[int, Any] = {}  # pid -> psutil.Process of every descendant ever sampled
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> tuple[int, int]:
        import psutil

        rss = pss = 0
        try:
            procs = [self._root, *self._root.children(recursive=True)]
        except psutil.Error:
            return 0, 0
        for proc in procs:
            self.seen.setdefault(proc.pid, proc)
            try:
                info = proc.memory_full_info()
                rss += info.rss
                pss += getattr(info, "pss", info.rss)
            except psutil.Error:
                pass
        return rss, pss

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), *self._sample()))
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
        return max(values, default=0)


# ---- skylift side -----------------------------------------------------------------------------


def run_skylift(args: argparse.Namespace, work: Path, every_row: bool) -> dict[str, Any]:
    """Set up skylift's trainer, run one GRPO step, return its timings and completions.
    `every_row`: train the rows whose advantages are all zero too (not skipped)."""
    from skylift.config import load_config
    from skylift.demo import demo_overrides
    from skylift.generator import Trajectory
    from skylift.trainer.loop import RLTrainer

    train_file = _write_data(work / "data", args.num_prompts)
    overrides = [
        *demo_overrides(fast_bf16=False, dynamic_sampling=False),  # float32 and one round, as TRL
        f"trainer.policy.model.path={MODEL}",
        "trainer.run_name=bench_grpo_step_vs_trl",
        f"trainer.log_dir={work / 'skylift_logs'}",
        f"trainer.ckpt_path={work / 'skylift_ckpts'}",
        f"trainer.export_path={work / 'skylift_exports'}",
        f"data.train_data=['{train_file}']",
        f"data.val_data=['{work / 'data' / 'validation.parquet'}']",
        "trainer.algorithm.advantage_estimator=grpo",
        "trainer.algorithm.use_kl_loss=false",
        "trainer.algorithm.use_kl_in_reward=false",
        "trainer.algorithm.loss_reduction=token_mean",
        f"trainer.train_batch_size={args.num_prompts}",
        f"trainer.policy_mini_batch_size={args.num_prompts}",
        f"generator.n_samples_per_prompt={args.group_size}",
        f"generator.max_generate_length={args.max_new_tokens}",
        "generator.sampling_params.temperature=1.0",
        "generator.zero_reward_on_non_stop=false",
        f"trainer.policy.optimizer_config.lr={args.lr}",
        f"trainer.gradient_checkpointing={str(args.skylift_gradient_checkpointing).lower()}",
        "trainer.bf16=false",
        "trainer.max_steps=1",
        "trainer.eval_before_train=false",
        "trainer.eval_interval=-1",
        "trainer.ckpt_interval=-1",
        "trainer.hf_save_interval=-1",
        "trainer.resume_mode=none",
        f"trainer.seed={args.seed}",
        *args.skylift_override,
        *(["trainer.skip_zero_advantage_rows=false"] if every_row else []),
    ]
    cfg = load_config(overrides)
    trainer = RLTrainer(cfg)
    recorded: list[Trajectory] = []
    original_generate = trainer.generate

    def recording_generate(rows: list[Any], evaluation: bool = False) -> list[Trajectory]:
        out = original_generate(rows, evaluation)
        if not evaluation:
            recorded.extend(out)
        return out

    trainer.generate = recording_generate  # type: ignore[method-assign]
    try:
        tick = time.perf_counter()
        trainer.setup()
        setup_s = time.perf_counter() - tick
        probe = StepProbe()
        probe.mark()
        tick = time.perf_counter()
        history = trainer.fit()
        fit_s = time.perf_counter() - tick
        probe.mark()
    finally:
        trainer.shutdown()
    steps = [h for h in history if "timing/step_s" in h]
    if len(steps) != 1:
        raise RuntimeError(f"expected exactly one training step from fit(), got {len(steps)}: {history}")
    metrics = steps[0]
    if len(recorded) != args.num_prompts * args.group_size:
        raise RuntimeError(
            f"skylift generated {len(recorded)} completions, expected {args.num_prompts * args.group_size}"
        )
    truth_by_uid = {}
    for tr in recorded:
        truth_by_uid[tr.uid] = str(tr.env_metadata.get("ground_truth"))
    return {
        "setup_s": setup_s,
        "step_s": metrics["timing/step_s"],
        "fit_s": fit_s,
        **probe.summary(),
        "phases": {k.removeprefix("timing/"): v for k, v in metrics.items() if k.startswith("timing/")},
        "reward_mean": metrics["reward/mean"],
        "rows_trained_frac": metrics.get("train/rows_trained_frac", 1.0),
        "response_length_mean": metrics["response_length/mean"],
        "response_length_max": metrics["response_length/max"],
        "gradient_checkpointing": args.skylift_gradient_checkpointing,
        "completions": [
            {
                "uid": tr.uid,
                "text": tr.response_text,
                "ground_truth": truth_by_uid[tr.uid],
                "reward": tr.reward,
            }
            for tr in recorded
        ],
    }


# ---- TRL side ---------------------------------------------------------------------------------


class _PhaseTimer:
    """Accumulates wall time per named phase; wraps bound methods of an object in place."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.open: dict[str, float] = {}

    def wrap(self, obj: Any, method: str, phase: str) -> None:
        original = getattr(obj, method)

        def timed(*a: Any, **kw: Any) -> Any:
            tick = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - tick

        setattr(obj, method, timed)

    def begin(self, phase: str) -> None:
        self.open[phase] = time.perf_counter()

    def end(self, phase: str) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - self.open.pop(phase)


def run_trl(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Build TRL's GRPOTrainer, run one step, return its timings and completions."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from skylift.models import prepare_model

    if args.trl_threads:
        torch.set_num_threads(args.trl_threads)
    model_dir = prepare_model(MODEL)
    rows = _train_rows(args.num_prompts)
    dataset = Dataset.from_list(
        [{"prompt": r["prompt"], "ground_truth": r["reward_spec"]["ground_truth"]} for r in rows]
    )
    recorded: list[dict[str, Any]] = []
    timer = _PhaseTimer()

    def recording_reward(
        prompts: list[Any], completions: list[Any], ground_truth: list[str], **kwargs: Any
    ) -> list[float]:
        rewards = hash_answer_reward(completions, ground_truth)
        for prompt, completion, truth, reward in zip(
            prompts, completions, ground_truth, rewards, strict=True
        ):
            text = completion if isinstance(completion, str) else completion[-1]["content"]
            question = prompt if isinstance(prompt, str) else prompt[-1]["content"]
            recorded.append({"uid": question, "text": text, "ground_truth": truth, "reward": reward})
        return rewards

    recording_reward.__name__ = "hash_answer_reward"

    class StepClock(TrainerCallback):
        """Times the optimizer step and the whole training step through Trainer callbacks."""

        probe = StepProbe()

        def on_step_begin(self, *a: Any, **kw: Any) -> None:
            self.probe.mark()
            timer.begin("step")

        def on_pre_optimizer_step(self, *a: Any, **kw: Any) -> None:
            timer.begin("optimizer")

        def on_optimizer_step(self, *a: Any, **kw: Any) -> None:
            timer.end("optimizer")

        def on_step_end(self, *a: Any, **kw: Any) -> None:
            timer.end("step")
            self.probe.mark()

    batch = args.num_prompts * args.group_size
    if batch % args.trl_micro_batch:
        raise ValueError(f"--trl-micro-batch {args.trl_micro_batch} must divide {batch} completions")
    config = GRPOConfig(
        output_dir=str(work / "trl_out"),
        per_device_train_batch_size=args.trl_micro_batch,
        gradient_accumulation_steps=batch // args.trl_micro_batch,
        num_generations=args.group_size,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        learning_rate=args.lr,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        beta=0.0,
        loss_type="dapo",  # token mean over the batch, as skylift's token_mean
        scale_rewards="group",
        num_iterations=1,
        max_steps=1,
        gradient_checkpointing=True,
        bf16=False,
        fp16=False,
        use_cpu=True,
        model_init_kwargs={"dtype": torch.float32},
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=args.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    tick = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    clock = StepClock()
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=[recording_reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    setup_s = time.perf_counter() - tick
    timer.wrap(trainer, "_generate_and_score_completions", "rollout")
    timer.wrap(trainer, "_generate", "generate")
    timer.wrap(trainer, "_calculate_rewards", "rewards")
    timer.wrap(trainer, "_prepare_inputs", "prepare_inputs")
    timer.wrap(trainer, "compute_loss", "forward_loss")
    timer.wrap(trainer, "training_step", "training_step")
    tick = time.perf_counter()
    result = trainer.train()
    train_s = time.perf_counter() - tick
    if trainer.state.global_step != 1:
        raise RuntimeError(f"TRL ran {trainer.state.global_step} optimizer steps, expected 1")
    if len(recorded) != batch:
        raise RuntimeError(f"TRL's reward function saw {len(recorded)} completions, expected {batch}")
    s = timer.seconds
    phases = {
        "generate_s": s.get("generate", 0.0),
        "rewards_s": s.get("rewards", 0.0),
        "rollout_other_s": s.get("rollout", 0.0) - s.get("generate", 0.0) - s.get("rewards", 0.0),
        "forward_loss_s": s.get("forward_loss", 0.0),
        "backward_s": s.get("training_step", 0.0) - s.get("prepare_inputs", 0.0) - s.get("forward_loss", 0.0),
        "optimizer_s": s.get("optimizer", 0.0),
        "step_s": s["step"],
    }
    lengths = [len(tokenizer(c["text"], add_special_tokens=False)["input_ids"]) for c in recorded]
    rewards = [c["reward"] for c in recorded]
    return {
        "trl_version": trl.__version__,
        "torch_threads": torch.get_num_threads(),
        "setup_s": setup_s,
        "step_s": s["step"],
        "train_s": train_s,
        **clock.probe.summary(),
        "phases": phases,
        "loss": float(result.training_loss),
        "reward_mean": sum(rewards) / len(rewards),
        "response_length_mean": sum(lengths) / len(lengths),
        "response_length_max": max(lengths),
        "completions": recorded,
    }


# ---- reward agreement -------------------------------------------------------------------------


def check_agreement(skylift_side: dict[str, Any], trl_side: dict[str, Any]) -> dict[str, Any]:
    """Score each side's completions with the other side's reward function and compare."""
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
    trl_done = trl_side["completions"]
    trl_agree = 0
    for c in trl_done:
        env_r = skylift_env_reward(c["text"], c["ground_truth"])
        fn_r = gsm8k_reward(c["text"], c["ground_truth"])
        if env_r == fn_r == c["reward"]:
            trl_agree += 1
        else:
            mismatches.append({"side": "trl", **c, "skylift_env": env_r, "gsm8k_reward": fn_r})
    sky_done = skylift_side["completions"]
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
        "rewards_agree": not mismatches and bool(trl_done) and bool(sky_done),
        "trl_correct": sum(c["reward"] for c in trl_done),
        "skylift_correct": sum(c["reward"] for c in sky_done),
        "mismatches": mismatches,
    }


# ---- driver -----------------------------------------------------------------------------------


def _run_child(side: str, args: argparse.Namespace, work: Path) -> tuple[dict[str, Any], TreeMemorySampler]:
    result_file = work / f"{side}_result.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--work", str(work)]
    cmd += [
        f"--num-prompts={args.num_prompts}",
        f"--group-size={args.group_size}",
        f"--max-new-tokens={args.max_new_tokens}",
        f"--lr={args.lr}",
        f"--seed={args.seed}",
        f"--trl-micro-batch={args.trl_micro_batch}",
        f"--trl-threads={args.trl_threads}",
    ]
    if args.skylift_gradient_checkpointing:
        cmd.append("--skylift-gradient-checkpointing")
    cmd += [f"--skylift-override={o}" for o in args.skylift_override]
    print(f"=== {side}: starting", flush=True)
    proc = subprocess.Popen(cmd, stdout=sys.stderr)
    sampler = TreeMemorySampler(proc.pid)
    sampler.start()
    try:
        rc = proc.wait(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the {side} side did not finish within {CHILD_TIMEOUT_S:.0f} s") from None
    finally:
        sampler.stop()
        leftovers = sampler.reap_leftovers()
        if leftovers:
            print(f"=== {side}: terminated leftover processes {leftovers}", file=sys.stderr, flush=True)
    if rc != 0 or not result_file.exists():
        raise RuntimeError(f"the {side} side failed (exit status {rc}); see its output above")
    return json.loads(result_file.read_text()), sampler


def _fmt_load(side: dict[str, Any]) -> str:
    start, end = side["loadavg_1min"]
    return (
        f"CPU seconds of the process tree during the step {side['cpu_s']:.1f}; "
        f"1-min load average {start:.1f} at the start, {end:.1f} at the end (2 cores, shared machine)"
    )


def _fmt_phases(phases: dict[str, float]) -> str:
    return ", ".join(f"{k.removesuffix('_s')} {v:.1f}s" for k, v in phases.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--trl-micro-batch",
        type=int,
        default=32,
        help="TRL's per_device_train_batch_size; gradient accumulation makes up the rest of the batch",
    )
    parser.add_argument(
        "--trl-threads",
        type=int,
        default=0,
        help="torch intra-op threads in TRL's process (0 = torch's default, one per core). With the "
        "default, a loaded machine slows TRL's small per-token ops ~20x (threads wait on each other)",
    )
    parser.add_argument(
        "--skylift-gradient-checkpointing",
        action="store_true",
        help="turn on gradient checkpointing in skylift (the demo runs without it; TRL always has it on)",
    )
    parser.add_argument(
        "--skylift-override", action="append", default=[], help="extra key=value for skylift's config"
    )
    parser.add_argument("--order", choices=["skylift-first", "trl-first"], default="skylift-first")
    parser.add_argument("--side", choices=[*SKY_RUNS, "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.side is not None:  # child process: run one side, write its result
        work = args.work
        if args.side == "trl":
            result = run_trl(args, work)
        else:
            result = run_skylift(args, work, every_row=args.side == "skylift")
        (work / f"{args.side}_result.json").write_text(json.dumps(result))
        return 0

    try:
        import trl  # noqa: F401
    except ImportError:
        print("TRL is not installed: .venv/bin/pip install trl==1.16.0", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="grpo_vs_trl_") as tmp:
        work = Path(tmp)
        sides = [*SKY_RUNS, "trl"] if args.order == "skylift-first" else ["trl", *SKY_RUNS]
        results: dict[str, dict[str, Any]] = {}
        memory: dict[str, TreeMemorySampler] = {}
        for side in sides:
            results[side], memory[side] = _run_child(side, args, work)
    return report(args, results, memory)


def _skylift_lines(label: str, sky: dict[str, Any], peak: float, peak_step: float, peak_pss: float) -> None:
    print(
        f"skylift ({label}): step {sky['step_s']:.1f} s ({_fmt_phases(sky['phases'])}); fit() "
        f"{sky['fit_s']:.1f} s; set-up {sky['setup_s']:.1f} s (not timed); gradient checkpointing "
        f"{'on' if sky['gradient_checkpointing'] else 'off'}"
    )
    print(
        f"    reward {sky['reward_mean']:.3f}, rows trained {sky['rows_trained_frac']:.0%} (rows whose "
        f"advantages are all zero have exactly zero gradient), response length mean "
        f"{sky['response_length_mean']:.1f} max {sky['response_length_max']:.0f}; peak summed RSS "
        f"{peak:.2f} GiB (during the step {peak_step:.2f}), peak summed PSS {peak_pss:.2f} GiB"
    )
    print(f"    {_fmt_load(sky)}")


def report(
    args: argparse.Namespace, results: dict[str, dict[str, Any]], memory: dict[str, TreeMemorySampler]
) -> int:
    """Print every run's figures and the reward agreement; the last line is the JSON summary.
    Returns 0 when the rewards agree, else 1."""
    sides = list(results)
    sky, default, trl_res = results["skylift"], results["skylift-default"], results["trl"]
    agreements = {run: check_agreement(results[run], trl_res) for run in SKY_RUNS}
    ratio = sky["step_s"] / trl_res["step_s"]
    ratio_default = default["step_s"] / trl_res["step_s"]
    gib = 2**30
    peak = {side: memory[side].peak() / gib for side in sides}
    peak_step = {side: memory[side].peak(*results[side]["window"]) / gib for side in sides}
    peak_pss = {side: memory[side].peak(pss=True) / gib for side in sides}

    n = args.num_prompts * args.group_size
    print()
    print(
        f"one GRPO step, {MODEL} fp32, {args.num_prompts} prompts x {args.group_size} samples, "
        f"<= {args.max_new_tokens} new tokens, lr {args.lr:g}, no KL"
    )
    for run, label in zip(SKY_RUNS, ("every row trained", "default settings"), strict=True):
        _skylift_lines(label, results[run], peak[run], peak_step[run], peak_pss[run])
    print(
        f"TRL {trl_res['trl_version']}: step {trl_res['step_s']:.1f} s ({_fmt_phases(trl_res['phases'])}); "
        f"train() {trl_res['train_s']:.1f} s; set-up {trl_res['setup_s']:.1f} s (not timed); "
        f"gradient checkpointing on, micro-batch {args.trl_micro_batch}, "
        f"{trl_res['torch_threads']} torch thread(s)"
    )
    print(
        f"    reward {trl_res['reward_mean']:.3f}, response length mean {trl_res['response_length_mean']:.1f} "
        f"max {trl_res['response_length_max']:.0f}; peak summed RSS {peak['trl']:.2f} GiB "
        f"(during the step {peak_step['trl']:.2f}), peak summed PSS {peak_pss['trl']:.2f} GiB"
    )
    print(f"    {_fmt_load(trl_res)}")
    for run, agreement in agreements.items():
        print(
            f"reward agreement ({run}): TRL's {n} completions scored by skylift's arithmetic env and "
            f"gsm8k_reward: {agreement['trl_completions_scored_by_skylift']} agree; skylift's scored by "
            f"the TRL-style function: {agreement['skylift_completions_scored_by_trl_style']} agree"
        )
        for m in agreement["mismatches"]:
            print(f"    MISMATCH {json.dumps(m)}")
    print(
        f"ratio skylift/TRL (one step, every row trained): {ratio:.3f} (goal <= 0.35); "
        f"with the default settings: {ratio_default:.3f}"
    )
    summary = {
        "ratio": round(ratio, 4),
        "ratio_default": round(ratio_default, 4),
        "skylift_step_s": round(sky["step_s"], 3),
        "skylift_default_step_s": round(default["step_s"], 3),
        "trl_step_s": round(trl_res["step_s"], 3),
        "ratio_outer": round(sky["fit_s"] / trl_res["train_s"], 4),
        "skylift_fit_s": round(sky["fit_s"], 3),
        "trl_train_s": round(trl_res["train_s"], 3),
        "skylift_phases_s": {k: round(v, 3) for k, v in sky["phases"].items()},
        "skylift_default_phases_s": {k: round(v, 3) for k, v in default["phases"].items()},
        "trl_phases_s": {k: round(v, 3) for k, v in trl_res["phases"].items()},
        "skylift_peak_rss_gib": round(peak["skylift"], 3),
        "trl_peak_rss_gib": round(peak["trl"], 3),
        "skylift_step_peak_rss_gib": round(peak_step["skylift"], 3),
        "trl_step_peak_rss_gib": round(peak_step["trl"], 3),
        "skylift_peak_pss_gib": round(peak_pss["skylift"], 3),
        "skylift_default_peak_pss_gib": round(peak_pss["skylift-default"], 3),
        "trl_peak_pss_gib": round(peak_pss["trl"], 3),
        "skylift_step_cpu_s": round(sky["cpu_s"], 2),
        "skylift_default_step_cpu_s": round(default["cpu_s"], 2),
        "trl_step_cpu_s": round(trl_res["cpu_s"], 2),
        "cpu_ratio": round(sky["cpu_s"] / max(trl_res["cpu_s"], 1e-9), 4),
        "skylift_loadavg": [round(x, 2) for x in sky["loadavg_1min"]],
        "skylift_default_loadavg": [round(x, 2) for x in default["loadavg_1min"]],
        "trl_loadavg": [round(x, 2) for x in trl_res["loadavg_1min"]],
        "skylift_reward_mean": round(sky["reward_mean"], 4),
        "skylift_default_reward_mean": round(default["reward_mean"], 4),
        "skylift_rows_trained_frac": round(sky["rows_trained_frac"], 4),
        "skylift_default_rows_trained_frac": round(default["rows_trained_frac"], 4),
        "trl_reward_mean": round(trl_res["reward_mean"], 4),
        "reward_agreement_trl_by_skylift": agreements["skylift"]["trl_completions_scored_by_skylift"],
        "reward_agreement_skylift_by_trl_style": {
            run: a["skylift_completions_scored_by_trl_style"] for run, a in agreements.items()
        },
        "rewards_agree": all(a["rewards_agree"] for a in agreements.values()),
        "trl_version": trl_res["trl_version"],
        "trl_threads": trl_res["torch_threads"],
    }
    print(json.dumps(summary))
    return 0 if summary["rewards_agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
