"""`skylift train --dry-run --gpus N [--gpu-memory-gib G] [--nodes M]`: the plan of a GPU run on a
machine without one, through the real CLI (`skylift.cli.main`, and one subprocess), over the tiny
local model's safetensors headers. Nothing is started: no Ray, no vLLM."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from skylift.cli import main
from skylift.cluster.gpu_sharing import shared_placement
from skylift.cluster.placement import PlacementRequest, infeasible_message, plan_placement, uses_ray
from skylift.config import load_config
from skylift.config.loading import load_config_for
from skylift.weight_sync.factory import placed_rule, transport_kind
from skylift.weight_sync.process_group import WeightSyncError

ROOT = Path(__file__).resolve().parents[2]
COLOCATE = "trainer.placement.colocate_all=true"


def plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str], list[str]]:
    """(exit code, stdout lines, stderr lines) of `skylift train --dry-run ARGS`."""
    rc = main(["train", "--dry-run", *args])
    out, err = capsys.readouterr()
    return rc, out.splitlines(), err.splitlines()


def line(lines: list[str], start: str) -> str:
    found = [entry for entry in lines if entry.startswith(start)]
    assert len(found) == 1, (start, lines)
    return found[0]


def test_one_gpu_colocate_all_takes_cuda_ipc_and_prints_the_split(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path
) -> None:
    rc, out, err = plan(capsys, "--gpus", "1", f"trainer.policy.model.path={tiny_model_dir}", COLOCATE)
    assert rc == 0, err
    assert (
        out[0]
        == "GPU plan for 1 node(s) x 1 GPU(s) of 80 GiB (nothing started; this machine's devices unused)"
    )
    assert line(out, "GPU defaults") == (
        "GPU defaults the run takes (keys not set): generator.model_dtype=bfloat16, trainer.bf16=True, "
        "generator.enforce_eager=False"
    )
    assert line(out, "placement:") == (
        "placement: colocate_all: 1 x {CPU: 1, GPU: 1} PACK; policy rank(s) 0, engine-0 rank(s) 0"
    )
    # ~1M float32 parameters: the trainer keeps its 1 GiB context, the buckets and a bf16 copy
    assert line(out, "colocated GPU") == (
        "colocated GPU of 80.0 GiB: the trainer keeps up to 1.2 GiB while the engines are awake; "
        "engines get gpu_memory_utilization 0.80"
    )
    assert (
        line(out, "weight sync")
        == "weight sync (auto): engine(s) 0: ipc (a worker on policy rank 0's GPU: CUDA IPC)"
    )
    assert err[-1] == "skylift: dry run: the configuration is valid; nothing was started"
    assert not any(entry.startswith("trainer:") for entry in out)  # the plan, not the config tree


def test_keys_the_user_set_keep_their_values(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path
) -> None:
    rc, out, _ = plan(
        capsys, "--gpus", "2", f"trainer.policy.model.path={tiny_model_dir}", "trainer.bf16=false",
        "generator.enforce_eager=true", "generator.model_dtype=float32",
    )  # fmt: skip
    assert rc == 0
    assert line(out, "GPU defaults") == "GPU defaults the run takes (keys not set): none, every one is set"
    cfg, applied = load_config_for(
        [f"trainer.policy.model.path={tiny_model_dir}", "trainer.bf16=false"], None, True
    )
    assert (
        applied == ["generator.model_dtype", "generator.enforce_eager"]
        and cfg.generator.model_dtype == "bfloat16"
    )
    assert load_config_for([], None, False)[1] == []


def test_eight_gpus_policy_and_ref_on_four_engines_on_four_take_nccl(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path
) -> None:
    rc, out, err = plan(
        capsys, "--gpus", "8", f"trainer.policy.model.path={tiny_model_dir}",
        "trainer.placement.policy_num_gpus_per_node=4", "trainer.placement.ref_num_gpus_per_node=4",
        "trainer.algorithm.use_kl_loss=true", "generator.num_inference_engines=4",
    )  # fmt: skip
    assert rc == 0, err
    placement = [entry for entry in out if entry.startswith("placement:")]
    assert (
        placement[0]
        == "placement: policy+ref: 4 x {CPU: 1, GPU: 1} PACK; policy rank(s) 0-3, ref rank(s) 0-3"
    )
    assert placement[1:] == [
        f"placement: engine-{e}: 1 x {{CPU: 1, GPU: 1}} STRICT_PACK; engine-{e} rank(s) 0" for e in range(4)
    ]
    assert line(out, "fits") == "fits on 1 node(s) x 8 GPU(s) of 80 GiB: 8 bundle(s), 8 GPU(s) in all"
    assert (
        line(out, "weight sync")
        == "weight sync (auto): engine(s) 0-3: nccl (on GPUs of its own: NCCL broadcast)"
    )
    assert not any("colocat" in entry for entry in out)


def test_a_plan_the_cluster_cannot_hold_stops_with_the_runs_line(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path
) -> None:
    # two joined nodes of 2 GPUs: 4 policy GPUs and an engine's are 5
    rc, out, err = plan(
        capsys, "--gpus", "2", "--nodes", "2", f"trainer.policy.model.path={tiny_model_dir}",
        "trainer.placement.policy_num_gpus_per_node=4",
    )  # fmt: skip
    assert rc == 2
    assert err == [
        "skylift: the cluster cannot hold the requested placement (policy: 4 x {CPU: 1, GPU: 1} PACK; engine-0: "
        "1 x {CPU: 1, GPU: 1} STRICT_PACK): all groups together need {CPU: 5, GPU: 5}, the cluster has "
        "{CPU: 10, GPU: 4}. The cluster has 2 node(s): node0 {CPU: 5, GPU: 2}, node1 {CPU: 5, GPU: 2}"
    ]
    assert not any(entry.startswith(("fits", "weight sync")) for entry in out)
    # a policy spread over two nodes cannot be on one machine, even sharing its GPUs
    rc, _, err = plan(
        capsys, "--gpus", "8", f"trainer.policy.model.path={tiny_model_dir}",
        "trainer.placement.policy_num_nodes=2", "trainer.placement.policy_num_gpus_per_node=4",
    )  # fmt: skip
    assert rc == 2 and "must be on 2 different nodes, and 1 node(s) can hold one" in err[-1]
    rc, out, _ = plan(capsys, "--gpus", "4", "--nodes", "2", f"trainer.policy.model.path={tiny_model_dir}")
    assert rc == 0 and line(out, "note:").startswith(
        "note: the run plans GPU bundles and takes the GPU defaults only"
    )


def test_one_machine_short_of_gpus_shares_them_and_leaves_the_transport_to_run_time(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path
) -> None:
    rc, out, _ = plan(
        capsys,
        "--gpus",
        "1",
        f"trainer.policy.model.path={tiny_model_dir}",
        "generator.num_inference_engines=2",
    )
    assert rc == 0
    assert line(out, "fewer GPUs").startswith(
        "fewer GPUs than GPU bundles: the placement asks for 3 GPU bundle(s), and node0 has 1 GPU(s)"
    )
    assert line(out, "weight sync").startswith(
        "weight sync (auto): decided at run time: which ranks share a GPU"
    )
    assert "note: Ray packs" not in out  # one policy rank: nothing for NCCL to refuse
    rc, out, _ = plan(
        capsys,
        "--gpus",
        "2",
        "trainer.placement.policy_num_gpus_per_node=2",
        f"trainer.policy.model.path={tiny_model_dir}",
        "generator.num_inference_engines=2",
    )
    assert rc == 0 and line(out, "note: Ray packs").startswith(
        "note: Ray packs a group's shared bundles onto one GPU, so policy ranks would share one"
    )


def test_colocate_all_where_the_trainer_leaves_under_5_percent_is_refused(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path
) -> None:
    rc, _, err = plan(
        capsys,
        "--gpus",
        "1",
        "--gpu-memory-gib",
        "1.2",
        f"trainer.policy.model.path={tiny_model_dir}",
        COLOCATE,
    )
    assert rc == 2
    assert err[-1].startswith(
        "skylift: the trainer keeps about 1.2 GiB of each 1.2 GiB GPU while the engines"
    )
    assert "(at least 0.05 needed)" in err[-1]


def test_forced_nccl_on_a_shared_gpu_is_refused_and_elsewhere_kept(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path
) -> None:
    model = f"trainer.policy.model.path={tiny_model_dir}"
    rc, _, err = plan(capsys, "--gpus", "1", model, COLOCATE, "generator.weight_sync_backend=nccl")
    assert rc == 2
    assert err[-1].startswith(
        "skylift: weight_sync_backend=nccl cannot work: the trainer's rank 0 and engine 0's"
    )
    assert err[-1].endswith("use weight_sync_backend=auto (CUDA IPC for a same-GPU engine) or ipc")
    rc, _, err = plan(
        capsys, "--gpus", "1", model, "trainer.placement.backend=local", "generator.weight_sync_backend=nccl"
    )
    assert rc == 2 and "NCCL 2.29 refuses two ranks on one GPU" in err[-1]
    rc, out, _ = plan(capsys, "--gpus", "2", model, "generator.weight_sync_backend=nccl")
    assert (
        rc == 0 and line(out, "weight sync") == "weight sync: nccl, forced by generator.weight_sync_backend"
    )


def test_tensor_parallel_engines_get_their_bundle_indices(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path
) -> None:
    tp = ["generator.num_inference_engines=2", "generator.inference_engine_tensor_parallel_size=2"]
    rc, out, _ = plan(capsys, "--gpus", "6", f"trainer.policy.model.path={tiny_model_dir}", *tp,
                      "trainer.placement.policy_num_gpus_per_node=2")  # fmt: skip
    assert rc == 0
    assert [entry for entry in out if entry.startswith("engine-")] == [
        f"engine-{e} (tensor parallel 2, vLLM's Ray executor): VLLM_RAY_BUNDLE_INDICES=0,1 VLLM_RAY_PER_WORKER_GPUS=1"
        for e in range(2)
    ]
    # colocated: one group, engine i on bundles 2i, 2i+1, half a GPU each (a policy rank shares it);
    # engine 0 shares rank 0's GPU (IPC), engine 1 not (NCCL): each served its own way
    rc, out, _ = plan(capsys, "--gpus", "4", f"trainer.policy.model.path={tiny_model_dir}", *tp, COLOCATE,
                      "trainer.placement.policy_num_gpus_per_node=4")  # fmt: skip
    assert rc == 0
    assert [entry for entry in out if entry.startswith("engine-")] == [
        "engine-0 (tensor parallel 2, vLLM's Ray executor): VLLM_RAY_BUNDLE_INDICES=0,1 VLLM_RAY_PER_WORKER_GPUS=0.5",
        "engine-1 (tensor parallel 2, vLLM's Ray executor): VLLM_RAY_BUNDLE_INDICES=2,3 VLLM_RAY_PER_WORKER_GPUS=0.5",
    ]
    assert line(out, "weight sync") == (
        "weight sync (auto): engine(s) 0: ipc (a worker on policy rank 0's GPU: CUDA IPC), engine(s) 1: nccl "
        "(on GPUs of its own: NCCL broadcast); each its own way: ipc for engine(s) 0, one nccl group for engine(s) 1"
    )


def test_a_model_without_safetensors_or_not_here_gets_a_note(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (bare / name).write_bytes((tiny_model_dir / name).read_bytes())
    rc, out, _ = plan(capsys, "--gpus", "1", f"trainer.policy.model.path={bare}", COLOCATE)
    assert rc == 0
    assert line(out, "colocation:") == (
        f"colocation: {bare} has no safetensors headers here or on the Hub to size the trainer "
        "from: engines keep generator.gpu_memory_utilization=0.8"
    )
    rc, out, _ = plan(capsys, "--gpus", "1", "trainer.policy.model.path=Qwen/Qwen2.5-7B-Instruct", COLOCATE)
    assert rc == 0
    assert line(out, "colocation:") == (  # offline here: neither a cached snapshot nor the Hub answers
        "colocation: Qwen/Qwen2.5-7B-Instruct has no safetensors headers here or on the Hub to size the "
        "trainer from: engines keep generator.gpu_memory_utilization=0.8"
    )


def test_remote_engines_and_no_ray(capsys: pytest.CaptureFixture[str], tiny_model_dir: Path) -> None:
    model = f"trainer.policy.model.path={tiny_model_dir}"
    remote = [
        "generator.run_engines_locally=false",
        "generator.remote_inference_engine_urls=['10.0.0.9:8001']",
    ]
    rc, out, _ = plan(capsys, "--gpus", "1", model, *remote)
    assert rc == 0
    assert line(out, "placement:").startswith("placement: no Ray (trainer.placement.backend=auto)")
    assert (
        line(out, "weight sync")
        == "weight sync (auto): decided at run time from the places the remote engines report"
    )
    rc, out, _ = plan(capsys, "--gpus", "1", model, "trainer.placement.backend=local")
    assert rc == 0 and line(out, "weight sync") == (
        "weight sync (auto): engine(s) 0: ipc (a worker on policy rank 0's GPU: CUDA IPC)"
    )
    # the in-process engines stay awake beside the trainer: their share leaves its peak (as the run)
    assert line(out, "the engines share the policy's GPU").endswith("engines get gpu_memory_utilization 0.80")
    rc, out, _ = plan(
        capsys, "--gpus", "1", "--gpu-memory-gib", "2", model, "trainer.placement.backend=local"
    )
    assert rc == 0 and "(asked 0.80)" in line(out, "the engines share the policy's GPU")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dry-run", "--gpus", "0"], "skylift: --gpus must be a whole number >= 1, got '0'"),
        (["--dry-run", "--gpus", "2.5"], "skylift: --gpus must be a whole number >= 1, got '2.5'"),
        (["--dry-run", "--gpus", "2", "--nodes", "0"], "skylift: --nodes must be a whole number >= 1, got '0'"),
        (["--dry-run", "--gpus", "2", "--gpu-memory-gib", "nan"], "skylift: --gpu-memory-gib must be a number of GiB > 0, got 'nan'"),
        (["--gpus", "2"], "skylift: --gpus plans a run without starting it: add --dry-run (a run uses the devices it sees)"),
        (["--dry-run", "--nodes", "2"], "skylift: --gpu-memory-gib and --nodes describe the GPUs of --gpus N: give --gpus too"),
    ],
)  # fmt: skip
def test_bad_flags_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["train", *args]) == 2
    out, err = capsys.readouterr()
    assert err.splitlines() == [message] and out == ""


def test_the_installed_command_plans_without_importing_vllm_or_ray(tiny_model_dir: Path) -> None:
    code = (
        "import sys; from skylift.cli import main; "
        f"rc = main(['train', '--dry-run', '--gpus', '2', 'trainer.policy.model.path={tiny_model_dir}']); "
        "assert not {'vllm', 'ray', 'skylift.rl.loop'} & set(sys.modules), 'the plan imported a runtime'; "
        "sys.exit(rc)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (
        "weight sync (auto): engine(s) 0: nccl (on GPUs of its own: NCCL broadcast)"
        in done.stdout.splitlines()
    )
    assert (
        "--gpus N"
        in subprocess.run(
            [sys.executable, "-m", "skylift.cli", "train", "--help"],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        ).stdout
    )


def test_the_runs_pure_parts_the_plan_shares() -> None:
    cfg = load_config(["generator.num_inference_engines=2"])
    assert uses_ray(cfg) and uses_ray(cfg, eval_only=True)
    remote = load_config(
        ["generator.run_engines_locally=false", "generator.remote_inference_engine_urls=['h:1']"]
    )
    assert not uses_ray(remote) and not uses_ray(remote, eval_only=True)
    request = PlacementRequest(num_engines=2, gpu=True)
    plan_, shared = shared_placement(
        request, [{"ip": "a", "resources": {"GPU": 2.0, "CPU": 8.0}}], joined=False
    )
    assert shared is not None and plan_.groups[0].bundles[0]["GPU"] == 0.5  # 3 bundles, 2 GPUs
    assert shared_placement(request, [{"ip": "a", "resources": {"GPU": 2.0}}], joined=True)[1] is None
    one = [{"ip": "a", "resources": {"GPU": 2.0, "CPU": 8.0}}]
    assert infeasible_message(plan_placement(PlacementRequest(num_engines=1, gpu=True)), one) is None
    refusal = infeasible_message(plan_placement(request), one)
    assert refusal is not None and refusal.endswith("The cluster has 1 node(s): a {CPU: 8, GPU: 2}")
    lora = load_config(["trainer.policy.model.lora.rank=8", "generator.weight_sync_backend=ipc"])
    with pytest.raises(WeightSyncError, match="a LoRA policy syncs its adapter"):
        transport_kind(lora)
    assert transport_kind(lora, lora_adapter=False) == "placed" and placed_rule(lora) == "ipc"
    assert placed_rule(load_config([])) == "auto"


def test_the_docs_example_is_the_commands_real_output(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path
) -> None:
    """docs/gpu.md's "Planning a GPU run on any machine" shows a command and what it prints."""
    import shlex

    text = (ROOT / "docs" / "gpu.md").read_text().split("## Planning a GPU run on any machine", 1)[1]
    command, shown = (block.split("\n", 1)[1] for block in text.split("```")[1:4:2])
    args = shlex.split(command.replace("\\\n", " "))
    assert args[:3] == ["skylift", "train", "--dry-run"] and "trainer.policy.model.path=tiny-qwen2" in args
    assert main(args[1:]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() + err.splitlines() == shown.strip("\n").splitlines()


def test_a_lora_adapters_group_follows_the_planned_places(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path
) -> None:
    lora = [f"trainer.policy.model.path={tiny_model_dir}", "trainer.policy.model.lora.rank=8"]
    rc, out, _ = plan(capsys, "--gpus", "2", *lora)
    assert rc == 0 and line(out, "weight sync").startswith(
        "weight sync: the LoRA adapter over a nccl group ("
    )
    rc, out, _ = plan(capsys, "--gpus", "1", *lora, "trainer.placement.colocate_all=true")
    assert rc == 0 and line(out, "weight sync").startswith(
        "weight sync: the LoRA adapter over a gloo group ("
    )
    rc, out, _ = plan(capsys, "--gpus", "1", *lora)  # two bundles on one GPU: Ray's choice
    assert rc == 0 and "chosen at run time" in line(out, "weight sync")
