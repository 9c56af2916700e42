"""A deterministic built-in text corpus for training the tiny model's tokenizer.

It mixes English-like sentences, GSM8K-style arithmetic with ``#### answer`` lines, digit runs and
ChatML-formatted chat turns, so that the tokenizer sees the kinds of text skylift's tests and
demos feed it. The same seed always yields the same lines.
"""

from __future__ import annotations

import random

_NAMES = ["Alice", "Bob", "Carla", "Dmitri", "Eve", "Farah", "Gus", "Hana", "Ivan", "Jun", "Kofi", "Lena"]
_ITEMS = [
    "apples", "books", "marbles", "cookies", "pencils", "stickers", "eggs", "coins", "cards",
    "shells", "balloons", "tickets", "cupcakes", "stamps", "oranges", "flowers",
]  # fmt: skip
_VERBS = ["buys", "finds", "gives away", "sells", "collects", "loses", "bakes", "picks"]
_ADJECTIVES = ["small", "large", "red", "quiet", "bright", "old", "new", "happy", "clever", "green"]
_NOUNS = ["dog", "river", "city", "garden", "teacher", "window", "train", "market", "song", "model"]
_PLACES = ["the park", "the store", "school", "the library", "the farm", "the beach", "home"]
_QUESTIONS = [
    "What is {a} plus {b}?",
    "How much is {a} times {b}?",
    "Can you explain why the sky is blue?",
    "Write a short poem about the {noun}.",
    "What is the capital of France?",
    "Please summarize the story in one sentence.",
    "Solve {a} - {b} and show your work.",
]
_ANSWERS = [
    "The answer is {r}.",
    "Sure! {a} and {b} give {r}.",
    "Light from the sun is scattered by the air, and blue light is scattered the most.",
    "The {adj} {noun} sleeps by the {noun2} at night.",
    "Paris is the capital of France.",
    "A {adj} {noun} learns to sing.",
    "First we compute {a} - {b} = {r}. So the result is {r}.",
]
_COMMON_WORDS = (
    "the of and to in is it you that he was for on are with as his they be at one have this from "
    "or had by word but what some we can out other were all there when up use your how said an each "
    "she which do their time if will way about many then them write would like so these her long "
    "make thing see him two has look more day could go come did number sound no most people my over "
    "know water than call first who may down side been now find any new work part take get place "
    "made live where after back little only round man year came show every good me give our under "
    "name very through just form sentence great think say help low line differ turn cause much mean "
    "before move right boy old too same tell does set three want air well also play small end put "
    "home read hand port large spell add even land here must big high such follow act why ask men "
    "change went light kind off need house picture try us again animal point mother world near build "
    "self earth father head stand own page should country found answer school grow study still learn "
    "plant cover food sun four between state keep eye never last let thought tree cross farm hard "
    "start might story saw far sea draw left late run while press close night real life few north "
    "open seem together next white children begin got walk example ease paper group always music "
    "those both mark often letter until mile river car feet care second book carry took science eat "
    "room friend began idea fish mountain stop once base hear horse cut sure watch color face wood "
    "main enough plain girl usual young ready above ever red list though feel talk bird soon body dog "
    "family direct pose leave song measure door product black short numeral class wind question "
    "happen complete ship area half rock order fire south problem piece told knew pass since top "
    "whole king space heard best hour better true during hundred five remember step early hold west "
    "ground interest reach fast verb sing listen six table travel less morning ten simple several "
    "vowel toward war lay against pattern slow center love person money serve appear road map rain "
    "rule govern pull cold notice voice unit power town fine certain fly fall lead cry dark machine "
    "note wait plan figure star box noun field rest correct able pound done beauty drive stood "
    "contain front teach week final gave green quick develop ocean warm free minute strong special "
    "mind behind clear tail produce fact street inch multiply nothing course stay wheel full force "
    "blue object decide surface deep moon island foot system busy test record boat common gold "
    "possible plane instead dry wonder laugh thousand ago ran check game shape equate hot miss "
    "brought heat snow tire bring yes distant fill east paint language among total remainder"
).split()
_UNICODE = [
    "Café déjà vu — naïve façade.",
    "Grüße aus München, schöne Straße!",
    "こんにちは世界",
    "数学很有趣。",
    "Привет, мир!",
    "Temperature: 21°C ± 0.5°C, π ≈ 3.14159",
    "Emoji test 🙂🚀",
]


def _sentence(rng: random.Random) -> str:
    name, verb, item = rng.choice(_NAMES), rng.choice(_VERBS), rng.choice(_ITEMS)
    adj, noun, place = rng.choice(_ADJECTIVES), rng.choice(_NOUNS), rng.choice(_PLACES)
    forms = [
        f"{name} {verb} {rng.randint(2, 40)} {item} at {place}.",
        f"The {adj} {noun} is near {place}.",
        f"Yesterday, {name} saw a {adj} {noun} and smiled.",
        f"Why does the {noun} look so {adj} today?",
        f'{name} said: "I don\'t think the {noun} will come back."',
    ]
    return rng.choice(forms)


def _free_sentence(rng: random.Random) -> str:
    words = [rng.choice(_COMMON_WORDS) for _ in range(rng.randint(5, 14))]
    words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice([".", ".", "!", "?", ","])


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    op = rng.choice(["+", "-", "*"])
    result = a + b if op == "+" else a - b if op == "-" else a * b
    return f"{a} {op} {b} = {result}\n#### {result}"


def _word_problem(rng: random.Random) -> str:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(2, 60), rng.randint(2, 60)
    return (
        f"{name} has {a} {item}. {name} buys {b} more {item}. How many {item} does {name} have now?\n"
        f"{name} has {a} + {b} = {a + b} {item}.\n#### {a + b}"
    )


def _chat(rng: random.Random) -> str:
    a, b = rng.randint(1, 99), rng.randint(1, 99)
    fields = {
        "a": a,
        "b": b,
        "r": a + b,
        "adj": rng.choice(_ADJECTIVES),
        "noun": rng.choice(_NOUNS),
        "noun2": rng.choice(_NOUNS),
    }
    question = rng.choice(_QUESTIONS).format(**fields)
    answer = rng.choice(_ANSWERS).format(**fields)
    system = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" if rng.random() < 0.5 else ""
    return (
        f"{system}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"
        "<|endoftext|>"
    )


def build_corpus(seed: int = 0, n_lines: int = 6000) -> list[str]:
    """Return ``n_lines`` deterministic training texts (same seed, same texts)."""
    rng = random.Random(seed)
    makers = [_sentence, _free_sentence, _free_sentence, _arithmetic, _word_problem, _chat]
    lines = [rng.choice(makers)(rng) for _ in range(n_lines)]
    lines.extend(_UNICODE)
    lines.append(" ".join(str(i) for i in range(100)))
    return lines
