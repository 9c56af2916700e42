"""More tinker-cookbook 0.6.1 recipes, unmodified, against `skylift tinker serve` (the session's
`tinker_server`, tiny model, `role_colon` renderer, offline):

- `preference/train_dpo` on a local JSONL comparison file (`ComparisonBuilderFromJsonl`) with a
  held-out test file, so the recipe evaluates every step: `forward_backward_custom` (the DPO loss
  runs client-side) and the reference sampler it made at the start, used again after every newer
  evaluation sampler.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

API_KEY = "tml-dummy"
RENDERER = "role_colon"
DPO_STEPS = 6


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def cookbook(tinker_server: Any) -> Iterator[None]:
    """What the cookbook needs to run offline against `tinker_server`."""
    import tinker_cookbook.utils.cost_estimation as cost_estimation

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_API_KEY", API_KEY)
        mp.setattr(cost_estimation, "_pricing_fetched", True)  # no pricing download
        yield


def _comparison(i: int) -> dict[str, Any]:
    a, b = i % 7 + 1, i % 5 + 2
    right = {"role": "assistant", "content": f"{a + b}"}
    wrong = {"role": "assistant", "content": f"{a + b + 3} or so"}
    first, second, label = (right, wrong, "A") if i % 2 == 0 else (wrong, right, "B")
    return {
        "comparison": {
            "prompt_conversation": [{"role": "user", "content": f"What is {a} + {b}?"}],
            "completion_A": [first],
            "completion_B": [second],
        },
        "label": label,
    }


def test_train_dpo_evaluating_every_step(
    cookbook: None, tinker_server: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from tinker_cookbook.preference import train_dpo
    from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
    from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    model = str(tiny_model_dir)
    train_file = _write_jsonl(tmp_path / "train.jsonl", [_comparison(i) for i in range(2 * DPO_STEPS)])
    test_file = _write_jsonl(tmp_path / "test.jsonl", [_comparison(100 + i) for i in range(2)])
    log_path = tmp_path / "dpo"
    config = train_dpo.Config(
        log_path=str(log_path),
        model_name=model,
        recipe_name="skylift_test_dpo",
        renderer_name=RENDERER,
        dataset_builder=DPODatasetBuilderFromComparisons(
            common_config=ChatDatasetBuilderCommonConfig(
                model_name_for_tokenizer=model, renderer_name=RENDERER, max_length=128, batch_size=2
            ),
            comparison_builder=ComparisonBuilderFromJsonl(
                train_path=str(train_file), test_path=str(test_file)
            ),
        ),
        learning_rate=1e-2,
        dpo_beta=0.5,
        lora_rank=4,
        base_url=tinker_server.url,
        eval_every=1,
        infrequent_eval_every=0,
        save_every=3,
        ttl_seconds=3600,
    )
    train_dpo.main(config)

    rows = _jsonl(log_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(DPO_STEPS))
    for row in rows:
        assert row["num_pairs"] == 2
        assert math.isfinite(row["dpo_loss"]) and row["dpo_loss"] > 0
        # every step evaluated on a fresh sampler of the current weights
        assert math.isfinite(row["test/nll"]) and row["test/nll"] > 0
    # step 0: the policy IS the reference, so the reference sampler's logprobs (engine) equal the
    # trainer's: zero margin and the loss is log 2
    assert rows[0]["dpo_loss"] == pytest.approx(math.log(2), abs=1e-3)
    assert abs(rows[0]["margin"]) < 2e-3
    # the reference sampler still answers at the last step, after five newer samplers, and the
    # policy has moved away from it (the margin is no longer zero)
    assert abs(rows[-1]["margin"]) > 1e-3
    assert rows[-1]["test/nll"] != rows[0]["test/nll"]
    saved = _jsonl(log_path / "checkpoints.jsonl")
    assert [c["name"] for c in saved] == ["000003", "final"]
    assert saved[-1]["epoch"] == 1
