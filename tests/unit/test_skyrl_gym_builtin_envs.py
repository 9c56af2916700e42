"""SkyRL-Gym's built-in text2sql and search environments through skylift's adapter, without vLLM:
a dataset row's other columns reach the env's extras (text2sql's ``db_id`` and ``data``), SkyRL's
default ``env_config`` fills what ``environment.skyrl_gym.<id>`` leaves out, the envs run against
real SQLite databases and a real BM25 retrieval server on 127.0.0.1 (tests/bm25_retrieval.py), and
per-environment metrics are aggregated as SkyRL aggregates them."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("skyrl_gym", reason="skyrl-gym is a dependency of skylift (pyproject)")
pytest.importorskip("rank_bm25", reason="rank-bm25 is in skylift's dev extra (pyproject)")

from bm25_retrieval import RetrievalServer, serve  # noqa: E402
from skyrl_gym_data import (  # noqa: E402
    CORPUS,
    make_sql_databases,
    search_rows,
    text2sql_rows,
    write_rows,
)

from skylift.compat.skyrl.gym import aggregate_env_metrics, configure  # noqa: E402
from skylift.data import PromptSample, load_prompt_file  # noqa: E402
from skylift.envs import make_env  # noqa: E402
from skylift.generator import Generator, Trajectory  # noqa: E402
from skylift.generator.metrics import rollout_metrics  # noqa: E402


@pytest.fixture
def retrieval() -> Iterator[RetrievalServer]:
    server = serve(CORPUS)
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _reset_run_config() -> Iterator[None]:
    yield
    configure({}, max_turns=1)


def test_a_rows_other_columns_reach_the_envs_extras(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "sql.parquet", text2sql_rows())
    first = load_prompt_file(path)[0]
    assert first.columns == {"db_id": "concert_singer", "data": "spider"}
    extras = first.env_extras()
    assert (extras["db_id"], extras["data"]) == ("concert_singer", "spider")
    assert extras["reward_spec"] == {"method": "rule", "ground_truth": "SELECT count(*) FROM singer"}
    assert Generator._extras(first)["db_id"] == "concert_singer"  # what the generator hands init()


def _sql_env(rows: list[PromptSample], db_path: Path, index: int):  # noqa: ANN202
    configure({"text2sql": {"db_path": str(db_path)}}, max_turns=3)
    env = make_env("text2sql")
    env.init(rows[index].prompt, Generator._extras(rows[index]))
    return env


def test_text2sql_runs_queries_on_the_sqlite_database_and_scores_the_solution(tmp_path: Path) -> None:
    db_path = make_sql_databases(tmp_path / "dbs")
    rows = load_prompt_file(write_rows(tmp_path / "sql.parquet", text2sql_rows()))
    env = _sql_env(rows, db_path, 1)  # synsql: SynSQL-2.5M/databases/library/library.sqlite
    first = env.step("<think>list them</think><sql>SELECT title FROM book ORDER BY year</sql>")
    assert not first.done and first.reward == 0.0
    text = first.observations[0]["content"]
    assert "Dune" in text and "Hyperion" in text and "You have 2 turns left" in text
    last = env.step("<think>filter</think><solution>SELECT title FROM book WHERE year >= 1984</solution>")
    assert last.done and last.reward == 1.0  # the same rows as the gold SQL
    wrong = _sql_env(rows, db_path, 0)
    assert wrong.step("<think>x</think><solution>SELECT 2</solution>").reward == 0.0  # 3 singers


def test_text2sql_scores_a_garbage_rollout_minus_one_at_max_turns(tmp_path: Path) -> None:
    """What the untrained model does: no <sql>, no <solution>; the env says so, and at max_turns the
    trajectory fails SkyRL-SQL's format check (-1)."""
    db_path = make_sql_databases(tmp_path / "dbs")
    rows = load_prompt_file(write_rows(tmp_path / "sql.parquet", text2sql_rows()))
    configure({"text2sql": {"db_path": str(db_path)}}, max_turns=2)
    env = make_env("text2sql")
    env.init(rows[0].prompt, Generator._extras(rows[0]))
    first = env.step("qq zx <sq")
    assert not first.done and "Your previous action is invalid" in first.observations[0]["content"]
    last = env.step("blah")
    assert last.done and last.reward == -1.0 and last.observations == []


def test_text2sql_without_the_database_says_where_it_looked(tmp_path: Path) -> None:
    rows = load_prompt_file(write_rows(tmp_path / "sql.parquet", text2sql_rows()))
    configure({"text2sql": {"db_path": str(tmp_path / "none")}}, max_turns=2)
    with pytest.raises(FileNotFoundError, match="concert_singer.sqlite"):
        make_env("text2sql").init(rows[0].prompt, Generator._extras(rows[0]))


def test_search_retrieves_from_the_bm25_server_and_scores_exact_match(
    tmp_path: Path, retrieval: RetrievalServer
) -> None:
    rows = load_prompt_file(write_rows(tmp_path / "search.parquet", search_rows()))
    # only search_url set: topk, timeout and log_requests come from SkyRL's defaults (3, 30, false)
    configure({"search": {"search_url": retrieval.url}}, max_turns=2)
    env = make_env("search")
    env.init(rows[0].prompt, Generator._extras(rows[0]))
    first = env.step("<think>look it up</think><search>capital of France</search>")
    assert not first.done and retrieval.queries == ["capital of France"]
    shown = json.loads(
        first.observations[0]["content"].strip().removeprefix("<information>").removesuffix("</information>")
    )
    docs = shown["result"].strip().splitlines()
    assert len(docs) == 3 and docs[0] == f"Doc 1: {CORPUS[0]['contents']}"  # BM25's best, topk 3
    assert env.step("<answer> Paris </answer>").reward == 1.0
    env = make_env("search")
    env.init(rows[1].prompt, Generator._extras(rows[1]))
    assert env.step("<answer>the Danube</answer>").reward == 0.0  # done on the answer, no search


def test_search_on_garbage_does_not_query_and_scores_zero(tmp_path: Path, retrieval: RetrievalServer) -> None:
    rows = load_prompt_file(write_rows(tmp_path / "search.parquet", search_rows()))
    configure({"search": {"search_url": retrieval.url}}, max_turns=2)
    env = make_env("search")
    env.init(rows[0].prompt, Generator._extras(rows[0]))
    first = env.step("zz <sear")
    assert first.observations == [{"role": "user", "content": "\n<information></information>\n"}]
    last = env.step("qq")
    assert last.done and last.reward == 0.0 and retrieval.queries == []


def _post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_retrieval_server_refuses_bad_requests_and_keeps_serving(retrieval: RetrievalServer) -> None:
    assert _post(retrieval.url, b"not json")[0] == 400
    status, body = _post(retrieval.url, json.dumps({"query": 3}).encode())
    assert status == 400 and "string 'query'" in body["error"]
    status, body = _post(retrieval.url, json.dumps({"query": "x", "topk": 10**9}).encode())
    assert status == 400 and "'topk' must be an integer in [1, 100]" in body["error"]
    assert _post(retrieval.url.replace("/retrieve", "/other"), b"{}")[0] == 404
    request = {"query": "Cairo river", "topk": 2, "return_scores": True}
    status, body = _post(retrieval.url, json.dumps(request).encode())
    # "cairo" is in doc 1 only, "river" in none: doc 1, then the first of the zero scores
    assert status == 200 and [d["document"]["id"] for d in body["result"][0]] == ["1", "0"]
    assert retrieval.queries == ["Cairo river"]


def _trajectory(env_class: str, reward: float, metrics: dict | None) -> Trajectory:
    return Trajectory(
        uid="0",
        prompt_ids=[1],
        response_ids=[2],
        loss_mask=[1],
        rollout_logprobs=[0.0],
        reward=reward,
        stop_reason="stop",
        env_class=env_class,
        env_metadata={"env_metrics": metrics} if metrics else {},
    )


def test_metrics_are_logged_per_environment_as_skyrl_aggregates_them() -> None:
    batch = [
        _trajectory("gsm8k_multi_turn", 1.0, {"steps": 1}),
        _trajectory("gsm8k_multi_turn", 0.0, {"steps": 3}),
        _trajectory("text2sql", -1.0, None),
        _trajectory("search", 0.0, None),
    ]
    metrics = rollout_metrics(batch)
    # GSM8kMultiTurnEnv.aggregate_metrics: avg_steps
    assert metrics["environment/gsm8k_multi_turn/avg_steps"] == 2.0
    assert metrics["environment/gsm8k_multi_turn/reward_mean"] == 0.5
    assert metrics["environment/text2sql/reward_mean"] == -1.0
    assert metrics["environment/search/reward_mean"] == 0.0
    assert "environment/avg_steps" not in metrics  # SkyRL's bare name only with one env class
    alone = rollout_metrics(batch[:2])
    assert alone["environment/avg_steps"] == 2.0
    # a class without its own aggregate_metrics: SkyRL's default, the mean of numeric fields
    assert aggregate_env_metrics(
        "text2sql", [{"calls": 1, "ok": True}, {"calls": 3, "ok": False, "s": "x"}]
    ) == {
        "calls": 2.0,
        "ok": 0.5,
    }


def test_the_generator_rolls_out_all_three_builtins_on_garbage(
    tmp_path: Path, retrieval: RetrievalServer, tiny_model_dir: Path
) -> None:
    """What tests/integration/test_skyrl_gym_builtins.py runs on the tiny model, with scripted
    replies: each env's rows by their id, 2 turns, the env's own observation untrained, its reward."""
    from skyrl_gym_data import gsm8k_multi_turn_rows
    from test_skyrl_gym_envs import FakeEngine
    from transformers import AutoTokenizer

    from skylift.data import PromptDataset
    from skylift.generator import GeneratorSettings
    from skylift.inference.types import SamplingParams

    db_path = make_sql_databases(tmp_path / "dbs")
    files = [
        write_rows(tmp_path / "gsm.parquet", gsm8k_multi_turn_rows(2)),
        write_rows(tmp_path / "sql.parquet", text2sql_rows()),
        write_rows(tmp_path / "search.parquet", search_rows()),
    ]
    rows = list(PromptDataset(files))
    configure({"text2sql": {"db_path": str(db_path)}, "search": {"search_url": retrieval.url}}, 2)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = FakeEngine(tokenizer, ["qq zz <sq", "blah ####"] * len(rows))
    settings = GeneratorSettings(max_generate_length=8, max_turns=2, batched=False, max_input_length=400)
    out = asyncio.run(Generator(engine, tokenizer, settings).generate(rows, 1, SamplingParams(max_tokens=8)))
    by_env = {tr.env_class: tr for tr in out[::2]}  # the first row of each file
    assert sorted(tr.env_class for tr in out) == sorted(["gsm8k_multi_turn", "text2sql", "search"] * 2)
    observations = {
        "gsm8k_multi_turn": "Now provide only the final numeric answer",
        "text2sql": "Your previous action is invalid",
        "search": "<information></information>",
    }
    rewards = {"gsm8k_multi_turn": 0.0, "text2sql": -1.0, "search": 0.0}
    for env_class, tr in by_env.items():
        assert tr.num_turns == 2 and observations[env_class] in tokenizer.decode(tr.response_ids)
        assert tr.reward == rewards[env_class]
    metrics = rollout_metrics(out)
    assert metrics["environment/gsm8k_multi_turn/avg_steps"] == 2.0
    assert metrics["environment/text2sql/reward_mean"] == -1.0
    assert retrieval.queries == []
