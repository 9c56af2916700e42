"""Data for SkyRL-Gym's built-in environments, written as SkyRL's example datasets write it.

- ``text2sql``: SQLite databases laid out as SkyRL-SQL's ``db_path`` (``spider/database/<db_id>/
  <db_id>.sqlite``, ``SynSQL-2.5M/databases/<db_id>/<db_id>.sqlite``) and rows with the top-level
  ``db_id`` and ``data`` columns the env reads from its extras, the gold SQL in ``reward_spec``;
- ``search``: a small corpus (for tests/bm25_retrieval.py) and Search-R1 rows (SkyRL's
  examples/train/search/searchr1_dataset.py: system + user prompt, ``reward_spec.ground_truth`` =
  ``{"target": [answers]}``);
- ``gsm8k_multi_turn``: rows as examples/train/turn_level_rewards/gsm8k_multi_turn_dataset.py
  writes them (the answer after ``####``, ``extra_info.max_turns``).

Each environment's rows go to their own parquet file: their ``reward_spec`` types differ.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

SINGERS = [
    (1, "Joe Sharp", "Netherlands", 52),
    (2, "Timbaland", "United States", 32),
    (3, "Justin", "France", 29),
]
BOOKS = [(1, "Dune", 1965), (2, "Neuromancer", 1984), (3, "Hyperion", 1989)]
SQL_TASKS = [  # (data, db_id, question, gold SQL)
    ("spider", "concert_singer", "How many singers are there?", "SELECT count(*) FROM singer"),
    ("synsql", "library", "Which books came out after 1980?", "SELECT title FROM book WHERE year > 1980"),
]
SQL_INSTRUCTIONS = (
    "Task: answer the question with one SQLite query. Think inside <think> </think>; run a query "
    "inside <sql> </sql> to see its result; give the final query inside <solution> </solution>."
)
CORPUS = [
    {"id": "0", "contents": "Paris is the capital and largest city of France, on the Seine."},
    {"id": "1", "contents": "The Nile flows north through Cairo into the Mediterranean Sea."},
    {"id": "2", "contents": "Canberra is the capital city of Australia."},
    {"id": "3", "contents": "Mount Everest is the highest mountain above sea level."},
    {"id": "4", "contents": "The Danube flows through Vienna, Budapest and Belgrade."},
    {"id": "5", "contents": "Tokyo is the capital of Japan and its largest city."},
]
SEARCH_TASKS = [("What is the capital of France?", ["Paris"]), ("Which river flows through Cairo?", ["Nile"])]
SEARCH_SYSTEM = "You are a helpful and harmless assistant."
SEARCH_PREFIX = (
    "Answer the given question. Reason inside <think> and </think>. To look something up, call a "
    "search engine by <search> query </search>; its results come between <information> and "
    "</information>. Give the answer inside <answer> and </answer>. Question: "
)
GSM8K_TASKS = [
    ("Tom has 3 apples and buys 4 more. How many apples does he have?", "7"),
    ("A box holds 6 pens. How many pens are in 2 boxes?", "12"),
]
GSM8K_INSTRUCTION = 'Let\'s think step by step and output a tentative numeric answer after "####".'


def make_sql_databases(root: Path) -> Path:
    """The two SQLite databases of `SQL_TASKS` under `root` (text2sql's ``db_path``)."""
    layout = {"spider": root / "spider" / "database", "synsql": root / "SynSQL-2.5M" / "databases"}
    for data, db_id, _, _ in SQL_TASKS:
        folder = layout[data] / db_id
        folder.mkdir(parents=True, exist_ok=True)
        with sqlite3.connect(folder / f"{db_id}.sqlite") as conn:
            if db_id == "concert_singer":
                conn.execute("CREATE TABLE singer (singer_id INTEGER, name TEXT, country TEXT, age INTEGER)")
                conn.executemany("INSERT INTO singer VALUES (?, ?, ?, ?)", SINGERS)
            else:
                conn.execute("CREATE TABLE book (book_id INTEGER, title TEXT, year INTEGER)")
                conn.executemany("INSERT INTO book VALUES (?, ?, ?)", BOOKS)
        conn.close()
    return root


def text2sql_rows() -> list[dict[str, Any]]:
    return [
        {
            "data_source": data,
            "prompt": [{"role": "user", "content": f"{SQL_INSTRUCTIONS}\nDatabase: {db_id}\nQuestion: {q}"}],
            "env_class": "text2sql",
            "reward_spec": {"method": "rule", "ground_truth": gold},
            "extra_info": {"index": i, "split": "train", "question": q},
            "db_id": db_id,
            "data": data,
        }
        for i, (data, db_id, q, gold) in enumerate(SQL_TASKS)
    ]


def search_rows() -> list[dict[str, Any]]:
    return [
        {
            "data_source": "searchR1_nq",
            "prompt": [
                {"role": "system", "content": SEARCH_SYSTEM},
                {"role": "user", "content": SEARCH_PREFIX + q},
            ],
            "env_class": "search",
            "reward_spec": {"method": "rule", "ground_truth": {"target": answers}},
            "extra_info": {"index": i, "split": "train", "question": q, "need_tools_kwargs": True},
        }
        for i, (q, answers) in enumerate(SEARCH_TASKS)
    ]


def gsm8k_multi_turn_rows(max_turns: int) -> list[dict[str, Any]]:
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{q} {GSM8K_INSTRUCTION}"}],
            "env_class": "gsm8k_multi_turn",
            "reward_spec": {"method": "rule", "ground_truth": answer},
            "extra_info": {"max_turns": max_turns, "split": "train", "index": i, "question": q},
        }
        for i, (q, answer) in enumerate(GSM8K_TASKS)
    ]


def write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path
