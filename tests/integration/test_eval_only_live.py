"""`skylift eval` (SkyRL's main_generate) against the session's tiny-model server: the figures under
skylift's and SkyRL's names, logged at step 0, each sample dumped, the same figures twice."""

from __future__ import annotations

import json
from pathlib import Path

from skylift.config import load_config
from skylift.data import write_addition_demo
from skylift.rl.eval_only import DUMP_NAME, EvalOnlyRun


def test_eval_only_against_a_remote_server(
    tiny_model_dir: Path, tiny_server_url: str, tmp_path: Path
) -> None:
    write_addition_demo(tmp_path / "data", num_train=4, num_val=4, seed=0)
    cfg = load_config(
        [
            f"trainer.policy.model.path={tiny_model_dir}",
            "generator.run_engines_locally=false",
            f"generator.remote_inference_engine_urls=['{tiny_server_url}']",
            f"data.train_data=['{tmp_path / 'no_such_file.parquet'}']",  # never read by eval
            f"data.val_data=['{tmp_path / 'data' / 'validation.parquet'}']",
            "generator.eval_n_samples_per_prompt=2",
            "generator.eval_sampling_params.temperature=1.0",
            "generator.eval_sampling_params.max_generate_length=8",
            "generator.seeded_sampling=true",
            "trainer.dump_eval_results=true",
            f"trainer.log_dir={tmp_path / 'logs'}",
            f"trainer.runs_dir={tmp_path / 'runs'}",
        ]
    )
    said: list[str] = []
    figures = []
    for _ in range(2):
        run = EvalOnlyRun(cfg, said.append)
        try:
            run.setup()
            figures.append(run.evaluate())
        finally:
            run.shutdown()
    first, second = figures
    for key in ("eval/all/avg_score", "eval/all/pass_at_2", "eval/skylift_addition-demo/avg_score"):
        assert key in first and first[key] == second[key], key  # seeded: the same figures again
    assert first["eval/accuracy"] == first["eval/all/avg_score"] and "eval/accuracy_stderr" in first
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 0] and rows[0]["eval/all/pass_at_2"] == first[
        "eval/all/pass_at_2"
    ]
    dumped = (tmp_path / "logs" / "eval" / DUMP_NAME).read_text().splitlines()
    assert len(dumped) == 8 and json.loads(dumped[0])["data_source"] == "skylift/addition-demo"
    assert any(line.startswith("eval accuracy ") for line in said)
    assert any("evaluation only" in line for line in said)
