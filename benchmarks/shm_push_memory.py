"""Rank 0's memory in a first shared-memory weight push (`weight_sync_backend=ipc`, CPU), by the
path a training run takes now against the one it replaced, on SmolLM2-135M (fp32 policy):

- gathered (the old first push): every tensor gathered and cast first, then copied into new
  shared buffers (`SharedWeightsRank.share_weights(keep=True)`);
- laid out (now): kept buffers laid out from `RLWorker.engine_weight_layout` (meta tensors), then
  filled as the gather yields (`shared_weights_plan(allocate=True)` + `fill_shared_weights`).

Each runs in a fresh process (its own high-water mark) after the weights are paged in, to fp32
engines (`dtype` None) and to bf16 engines; the figure is the peak resident memory above what the
process held before the push (the shared buffers count: their pages are touched as they are
written). No engine is involved: what rank 0 holds does not depend on it.

Prints one line per case and, last, a JSON line: {"ratio": laid-out / gathered extra peak (bf16),
...raw figures}.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

MODEL = "smollm2-135m-instruct"


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields[key].split()[0]) / 1024


def one(mode: str, dtype: str | None) -> dict[str, float]:
    """One push by `mode` ("gathered" / "laid_out") in this process; its figures."""
    import torch

    from skylift.cluster.worker_group import WorkerGroup
    from skylift.models import prepare_model
    from skylift.weight_sync.ipc.policy_rank import SharedWeightsRank
    from skylift.worker.training_worker import WorkerSettings

    group = WorkerGroup("policy", WorkerSettings(model_path=str(prepare_model(MODEL))), use_ray=False)
    group.setup()
    worker = group.workers[0]
    weights_mb = sum(t.numel() * t.element_size() for t in worker._model().state_dict().values()) / 2**20
    with torch.no_grad():  # page the weights in (a trained policy's are resident) and build the
        for _, t in worker.engine_weights():  # checkpoint names: only the push's own memory counts
            t.sum()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark starts from here
    before = _status_mb("VmRSS")
    start = time.perf_counter()
    if mode == "gathered":
        SharedWeightsRank.share_weights(worker, dtype, True)
    else:
        plan = SharedWeightsRank.shared_weights_plan(worker, 64 << 20, dtype, True)
        assert plan is not None, "the layout was not known before gathering"
        SharedWeightsRank.fill_shared_weights(worker, plan["buckets"], dtype)
    seconds = time.perf_counter() - start
    extra = _status_mb("VmHWM") - before
    SharedWeightsRank.release_shared_weights(worker, True)
    group.shutdown()
    return {"weights_mb": weights_mb, "extra_peak_mb": extra, "push_s": seconds}


def main() -> None:
    if len(sys.argv) == 3:  # a child: one case
        print(json.dumps(one(sys.argv[1], None if sys.argv[2] == "none" else sys.argv[2])))
        return
    figures: dict[str, float] = {}
    for dtype in ("none", "bfloat16"):
        for mode in ("gathered", "laid_out"):
            out = subprocess.run(
                [sys.executable, __file__, mode, dtype],
                capture_output=True,
                text=True,
                timeout=600,
                check=True,
            )
            result = json.loads(out.stdout.strip().splitlines()[-1])
            key = f"{mode}_{'fp32' if dtype == 'none' else 'bf16'}"
            figures[f"{key}_extra_peak_mb"] = round(result["extra_peak_mb"], 1)
            figures[f"{key}_push_s"] = round(result["push_s"], 3)
            figures["weights_mb"] = round(result["weights_mb"], 1)
            print(
                f"{MODEL} to {key.split('_')[-1]} engines, {mode}: rank 0's peak +{result['extra_peak_mb']:.0f} MB "
                f"over {result['weights_mb']:.0f} MB of weights, {result['push_s']:.2f} s",
                flush=True,
            )
    ratio = figures["laid_out_bf16_extra_peak_mb"] / figures["gathered_bf16_extra_peak_mb"]
    print(json.dumps({"ratio": round(ratio, 3), **figures}))


if __name__ == "__main__":
    main()
