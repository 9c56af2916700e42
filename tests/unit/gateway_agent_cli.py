"""A command-line agent for the gateway tests: reads task.json, asks the model once, prints the answer.

Usage: python gateway_agent_cli.py [ok|fail|sleep]
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from openai import OpenAI

mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
if mode == "sleep":
    time.sleep(60)
task = json.loads(Path("task.json").read_text())
client = OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"], max_retries=0)
text = client.chat.completions.create(model="policy", messages=task["prompt"]).choices[0].message.content
if mode == "fail":
    print("cannot go on", file=sys.stderr)
    sys.exit(3)
Path("answer.txt").write_text(text or "")
print(text)
