"""The assistant tokens `skylift sft` trains on are those `apply_chat_template` marks.

For every template TRL ships with a ``{% generation %}``-tagged training twin, the twin's
``return_assistant_tokens_mask`` on a multi-turn conversation (system prompt, two assistant turns)
equals the mask skylift reads off the untagged template (`skylift.supervised.tokens`), ids and all
(but for the newline of the assistant header that TRL's Qwen2.5 twin alone also marks);
a template that rewrites history is refused with the row named unless only the last turn trains;
plain-text prompt/completion rows train on the completion and EOS.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from skylift.data.chat import ChatDataError, ChatExample, example_of
from skylift.supervised.tokens import TokenizeError, tokenize_example

trl = pytest.importorskip("trl")
TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"
CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# template -> (eos, bos, other special tokens)
FAMILIES: dict[str, tuple[str, str | None, list[str]]] = {
    "qwen2_5": ("<|im_end|>", None, CHATML),
    "llama3": ("<|eot_id|>", "<|begin_of_text|>", ["<|start_header_id|>", "<|end_header_id|>"]),
    "phi3": ("<|end|>", None, ["<|user|>", "<|assistant|>", "<|system|>", "<|endoftext|>"]),
    "gemma3": ("<end_of_turn>", "<bos>", ["<start_of_turn>"]),
}
CONVERSATION = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5"},
    {"role": "user", "content": "And 4 + 4?"},
    {"role": "assistant", "content": "It is 8."},
]


@pytest.fixture(scope="module")
def vocabulary() -> str:
    from skylift.models.tiny_qwen2 import train_tokenizer

    return str(train_tokenizer().to_str())


def tokenizer(vocabulary: str, name: str, template: str) -> Any:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    eos, bos, specials = FAMILIES[name]
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(vocabulary),
        bos_token=bos,
        eos_token=eos,
        additional_special_tokens=[t for t in specials if t not in (eos, bos)],
        chat_template=(TRL_TEMPLATES / template).read_text(),
        clean_up_tokenization_spaces=False,
    )


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_assistant_mask_equals_the_tagged_templates_mask(vocabulary: str, name: str) -> None:
    plain = tokenizer(vocabulary, name, f"{name}.jinja")
    tagged = tokenizer(vocabulary, name, f"{name}_training.jinja")
    ours = tokenize_example(plain, example_of({"messages": CONVERSATION}))
    out = tagged.apply_chat_template(
        CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert ours.ids == list(out["input_ids"])
    theirs = list(out["assistant_masks"])
    if name == "qwen2_5":  # TRL's Qwen2.5 twin opens the block before the header's newline (its
        # Qwen3 twin after it): the generation prompt `<|im_start|>assistant\n` holds that newline
        header_newlines = [j for j, (a, b) in enumerate(zip(ours.loss_mask, theirs, strict=True)) if a != b]
        assert len(header_newlines) == 2 and all(plain.decode([ours.ids[j]]) == "\n" for j in header_newlines)
        theirs = [0 if j in header_newlines else m for j, m in enumerate(theirs)]
    assert ours.loss_mask == theirs
    assert sum(ours.loss_mask) > 0
    last = tokenize_example(plain, example_of({"messages": CONVERSATION}), last_only=True)
    first_turn = ours.loss_mask.index(1)
    assert last.loss_mask[first_turn] == 0 and sum(last.loss_mask) < sum(ours.loss_mask)


def test_a_template_that_rewrites_history_is_refused_unless_the_last_turn_only_trains(
    vocabulary: str,
) -> None:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    # drops every assistant turn but the last one's text before </think> (as Qwen3 does)
    template = (
        "{%- for m in messages -%}{%- set c = m['content'] -%}"
        "{%- if m['role'] == 'assistant' and not loop.last -%}{%- set c = c.split('</think>')[-1] -%}{%- endif -%}"
        "{{- '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' -}}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(vocabulary),
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=template,
    )
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>hm</think>Hello"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "<think>ok</think>Bye"},
    ]
    with pytest.raises(
        TokenizeError, match=r"data\.jsonl row 3: .*assistant message 1.*last_assistant_message"
    ):
        tokenize_example(tok, ChatExample(messages=messages), where="data.jsonl row 3")
    row = tokenize_example(tok, ChatExample(messages=messages), last_only=True)
    assert (
        tok.decode([t for t, m in zip(row.ids, row.loss_mask, strict=True) if m])
        == "<think>ok</think>Bye<|im_end|>\n"
    )


def test_prompt_completion_and_alpaca_rows(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tokenize_example(tok, example_of({"prompt": "Count to 3:", "completion": " 1 2 3"}))
    trained = [t for t, m in zip(text.ids, text.loss_mask, strict=True) if m]
    assert tok.decode(trained) == " 1 2 3" + tok.eos_token
    conversational = example_of(
        {
            "prompt": [{"role": "user", "content": "Hi"}],
            "completion": [{"role": "assistant", "content": "Yo"}],
        }
    )
    assert conversational.messages is not None and len(conversational.messages) == 2
    alpaca = example_of({"instruction": "Add.", "input": "2 3", "output": "5"})
    assert alpaca.messages == [
        {"role": "user", "content": "Add.\n\n2 3"},
        {"role": "assistant", "content": "5"},
    ]
    cut = tokenize_example(tok, example_of({"messages": CONVERSATION}), max_length=10)
    assert len(cut.ids) == len(cut.loss_mask) == 10


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"text": "hello"}, r"f\.jsonl row 0: no conversation: expected a non-empty 'messages' list"),
        ({"messages": [{"role": "user", "content": "Hi"}]}, "no assistant message"),
        ({"messages": ["Hi"]}, "message 0 is not a"),
    ],
)
def test_rows_without_a_trainable_conversation_are_named(row: dict, message: str) -> None:
    with pytest.raises(ChatDataError, match=message):
        example_of(row, where="f.jsonl row 0")
