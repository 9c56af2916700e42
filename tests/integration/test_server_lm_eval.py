"""EleutherAI's lm-evaluation-harness (PyPI `lm-eval`) as a client of `skylift serve`.

People evaluate checkpoints by pointing lm-eval's `local-completions` / `local-chat-completions`
at an OpenAI-compatible server. Tasks written here over local jsonl files (no download):
- a multiple-choice task (loglikelihoods: token-id prompts with `echo`, `logprobs=1`,
  `max_tokens=1`): every choice's loglikelihood equals transformers' on the same tokens (fp32);
- a `generate_until` task: lm-eval's greedy answers equal the engine's own greedy generations of
  the same prompt tokens through skylift's token route (`RemoteInferenceEngine`);
- the same generation task through `local-chat-completions` with the chat template.
lm-eval resolves the served name `tiny-qwen2` through the server's `/tokenizer_info` and
`/tokenize` (its `auto` tokenizer backend); `tokenizer=<path>` is the other way (docs/evaluation.md).
Uses the session's tiny server (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

from skylift.inference.remote import RemoteInferenceEngine
from skylift.inference.types import SamplingParams

pytestmark = pytest.mark.integration
lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is installed by scripts/setup.sh (the dev extra)")

SERVED = "tiny-qwen2"
QUESTIONS = [
    ("The sky on a clear day is", ["blue", "green", "loud", "seven"], 0),
    ("Two plus three is", ["five", "nine", "red", "cold"], 0),
    ("A cat says", ["meow", "moo", "quack", "tree"], 0),
    ("Water freezes when it is", ["cold", "hot", "happy", "square"], 0),
    ("The opposite of up is", ["down", "left", "soft", "bright"], 0),
    ("You read a", ["book", "spoon", "river", "cloud"], 0),
    ("Fish live in", ["water", "fire", "paper", "glass"], 0),
    ("The first month of the year is", ["January", "Monday", "summer", "noon"], 0),
]
MAX_GEN_TOKS = 12


def _write_tasks(root: Path) -> Path:
    """Two lm-eval task YAMLs over jsonl files in `root` (returned: the include path)."""
    mc = root / "mc.jsonl"
    mc.write_text(
        "".join(json.dumps({"question": q, "choices": c, "label": a}) + "\n" for q, c, a in QUESTIONS)
    )
    gen = root / "gen.jsonl"
    gen.write_text("".join(json.dumps({"question": q, "answer": c[a]}) + "\n" for q, c, a in QUESTIONS))
    (root / "skylift_mc.yaml").write_text(
        f"""task: skylift_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
"""
    )
    (root / "skylift_gen.yaml").write_text(
        f"""task: skylift_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {gen}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {MAX_GEN_TOKS}
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
"""
    )
    return root


@pytest.fixture(scope="module")
def server_url(tiny_server_url: str, tiny_model_dir: Path) -> str:
    """The session's tiny server with the tiny model's own weights: other modules (the RL trainer's)
    push trained weights to it, and then the original ones are synced back first."""
    from skylift.weight_sync import WeightSender

    engine = RemoteInferenceEngine(tiny_server_url)
    info = asyncio.run(engine.info(refresh=True))
    if info["weight_version"] != 0 or info["has_weight_update_group"]:
        model, _ = _hf(tiny_model_dir)

        async def restore() -> None:
            sender = WeightSender(timeout_s=60.0, update_timeout_s=120.0)
            await sender.init_group(
                [engine], master_address="127.0.0.1", backend="gloo", override_existing=True
            )
            await sender.send_state_dict([(n, p.detach()) for n, p in model.named_parameters()])
            await sender.close()

        asyncio.run(restore())
    return tiny_server_url


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(_write_tasks(tmp_path_factory.mktemp("lm_eval_tasks"))))


def _evaluate(model: str, model_args: dict[str, Any], tasks: Any, names: list[str], **kw: Any) -> dict:
    results = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=names, task_manager=tasks, log_samples=True, **kw
    )
    assert results is not None
    return results


def _hf(tiny_model_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def _reference_loglikelihood(model: Any, tokenizer: Any, context: str, continuation: str) -> float:
    """transformers' log p(continuation | context) on the tokens lm-eval sends (its `_encode_pair`:
    trailing spaces move to the continuation, which is the whole's tokens after the context's)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    ctx = tokenizer.encode(context, add_special_tokens=False)
    with torch.no_grad():
        logp = model(torch.tensor([whole])).logits[0].float().log_softmax(-1)
    return sum(float(logp[i - 1, whole[i]]) for i in range(len(ctx), len(whole)))


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def test_tokenizer_routes_serve_the_model_tokenizer(server_url: str, tiny_model_dir: Path) -> None:
    _, tokenizer = _hf(tiny_model_dir)
    info = _get(f"{server_url}/tokenizer_info")
    assert info["eos_token"] == tokenizer.eos_token
    body = json.dumps({"prompt": "The sky is blue", "add_special_tokens": False}).encode()
    request = urllib.request.Request(
        f"{server_url}/tokenize", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        tokens = json.loads(resp.read())["tokens"]
    assert tokens == tokenizer.encode("The sky is blue", add_special_tokens=False)


def test_loglikelihoods_and_greedy_answers_through_local_completions(
    server_url: str, tiny_model_dir: Path, tasks: Any
) -> None:
    args = {"model": SERVED, "base_url": f"{server_url}/v1/completions", "timeout": 120, "max_retries": 1}
    results = _evaluate("local-completions", args, tasks, ["skylift_mc", "skylift_gen"])
    model, tokenizer = _hf(tiny_model_dir)

    worst, correct = 0.0, 0
    for sample in results["samples"]["skylift_mc"]:
        got = [float(r[0]) for r in sample["filtered_resps"]]
        want = [_reference_loglikelihood(model, tokenizer, *a) for a in sample["arguments"]]
        worst = max(worst, *(abs(g - w) for g, w in zip(got, want, strict=True)))
        correct += int(max(range(len(want)), key=want.__getitem__) == sample["target"])
    print(
        f"\nlm-eval vs transformers: max |loglikelihood diff| {worst:.2e} over {len(QUESTIONS) * 4} choices"
    )
    assert worst <= 1e-3
    assert results["results"]["skylift_mc"]["acc,none"] == pytest.approx(correct / len(QUESTIONS))

    prompts = [
        tokenizer.encode(s["arguments"][0][0], add_special_tokens=False)
        for s in results["samples"]["skylift_gen"]
    ]
    answers = [s["resps"][0][0] for s in results["samples"]["skylift_gen"]]
    assert answers == _engine_greedy(server_url, prompts)


def _engine_greedy(url: str, prompts: list[list[int]]) -> list[str]:
    """The engine's greedy text for each prompt through skylift's token route, cut at a newline."""

    async def run() -> list[str]:
        engine = RemoteInferenceEngine(url)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=MAX_GEN_TOKS, stop=["\n"], logprobs=False)
            outputs = await engine.generate(prompts, params)
        finally:
            await engine.close()
        return [o.completions[0].text or "" for o in outputs]

    return asyncio.run(run())


def test_greedy_answers_through_local_chat_completions(
    server_url: str, tiny_model_dir: Path, tasks: Any
) -> None:
    args = {
        "model": SERVED,
        "base_url": f"{server_url}/v1/chat/completions",
        "timeout": 120,
        "max_retries": 1,
    }
    results = _evaluate("local-chat-completions", args, tasks, ["skylift_gen"], apply_chat_template=True)
    _, tokenizer = _hf(tiny_model_dir)
    samples = results["samples"]["skylift_gen"]
    prompts = []
    for sample in samples:
        context = sample["arguments"][0][0]  # lm-eval's JsonChatStr (a 1-tuple): the messages as JSON
        messages = json.loads(context if isinstance(context, str) else context[0])
        assert messages == [{"role": "user", "content": f"Question: {sample['doc']['question']}\nAnswer:"}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    assert [s["resps"][0][0] for s in samples] == _engine_greedy(server_url, prompts)
