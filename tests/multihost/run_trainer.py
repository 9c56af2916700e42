"""Run the RL trainer in this host and write what the tests check to a JSON file.

`python run_trainer.py OUT.json key=value ...`: set-up, then (while every actor is alive) the
actors' nodes from Ray's state API, then `fit()`; OUT.json holds `setup_s`, `actors`
(`[{"class", "node_ip"}]`), `history` and `error` (the message of a failure, if any).
"""

from __future__ import annotations

import json
import sys
import time
import traceback


def _actor_nodes() -> list[dict[str, str]]:
    import ray
    from ray.util.state import list_actors

    ip_of = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    return [
        {"class": a.class_name, "node_ip": ip_of.get(a.node_id, "?")}
        for a in list_actors(filters=[("state", "=", "ALIVE")], timeout=30)
    ]


def main(out: str, overrides: list[str]) -> int:
    from skylift.config import load_config
    from skylift.rl.build import build_run

    report: dict = {"actors": [], "history": [], "error": None}
    runtime, trainer = build_run(load_config(overrides))
    try:
        started = time.perf_counter()
        trainer.setup()
        report["setup_s"] = time.perf_counter() - started
        if runtime.use_ray:
            report["actors"] = _actor_nodes()
        report["history"] = trainer.fit()
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    finally:
        trainer.shutdown()
        with open(out, "w") as f:
            json.dump(report, f)
    return 1 if report["error"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
