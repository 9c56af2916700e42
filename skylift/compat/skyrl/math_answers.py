"""Math answers as SkyRL's geometry3k example grades them: the last ``\\boxed{...}`` of a text, and
whether two answers are the same (equal after normalising the LaTeX, or equal as expressions).

`last_boxed` finds the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces. `same_answer`
normalises both sides (``\\text{}`` wrapper, ``\\left``/``\\right``, ``\\dfrac``/``\\tfrac``, degree
marks, ``\\%``, ``$``, spaces, thousands commas, a short ``x =`` prefix, trailing units like ``cm``)
and compares the strings; failing that, it reads both as expressions (``\\frac``, ``\\sqrt``, ``\\pi``,
``^``, ``\\cdot``, implicit products: ``3\\sqrt{3}``) with sympy and compares their values. An
integer ground truth needs an integer answer (``6`` is not ``6.0001``); fractions that are written
out need the same reduced form (``\\frac{2}{4}`` is not ``\\frac{1}{2}``, as in SkyRL's grader).
Expressions that could make sympy hang (long, nested powers, more than two unknown letters) are
compared as strings only.
"""

from __future__ import annotations

import math
import re

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_UNITS = (
    "degrees", "degree", "centimeters", "centimeter", "cm", "meters", "meter", "units", "unit",
    "inches", "inch", "feet", "foot", "ft", "mm", "km", "m",
)  # fmt: skip
_SAFE = re.compile(r"^[0-9a-z+\-*/().,^ ]*$")
_FRACTION = re.compile(r"^-?\d+/\d+$")
MAX_EXPRESSION = 80


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` in `text` (None if there is none,
    or its braces do not close)."""
    matches = list(_BOX.finditer(text))
    if not matches:
        return None
    start = matches[-1].end()
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


def _unwrap_text(s: str) -> str:
    m = re.fullmatch(r"\\(?:text|textbf|mathrm)\{(.*)\}", s)
    return m.group(1) if m else s


def normalize(answer: str) -> str:
    """`answer` in a canonical spelling (see the module's docstring)."""
    s = _unwrap_text(answer.strip()).strip().rstrip(".")
    for old, new in (
        ("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"), ("^{\\circ}", ""), ("^\\circ", ""), ("\\circ", ""), ("°", ""), ("\\%", ""),
        ("%", ""), ("\\$", ""), ("$", ""), ("\n", ""),
    ):  # fmt: skip
        s = s.replace(old, new)
    s = re.sub(r"\\(?:text|mathrm)\{\s*([a-zA-Z ]*)\}", r" \1", s)  # \text{ cm} -> " cm" (dropped below)
    s = s.strip()
    unit = "|".join(_UNITS)
    s = re.sub(rf"(?<=[0-9}}])\s*(?:{unit})(?:\^?\{{?[23]\}}?)?$", "", s)
    lhs, eq, rhs = s.partition("=")
    if eq and "=" not in rhs and len(lhs.strip()) <= 2:
        s = rhs
    s = s.replace(" ", "")
    s = re.sub(
        r"\\frac\{(-?\d+)\}\{(\d+)\}|\\frac(\d)(\d)", lambda m: "/".join(g for g in m.groups() if g), s
    )
    while re.search(r"\d,\d{3}(?!\d)", s):
        s = re.sub(r"(\d),(\d{3})(?!\d)", r"\1\2", s)
    if s.startswith("."):
        s = "0" + s
    if re.fullmatch(r"-?\d+\.0+", s):
        s = s.split(".")[0]
    return s


def _latex_to_python(s: str) -> str:
    """A normalised answer as a Python-like expression for sympy (``\\frac{a}{b}`` -> ``(a)/(b)``)."""
    for _ in range(5):
        s = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", s)
        s = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", s)
    s = re.sub(r"\\frac(\d)(\d)", r"((\1)/(\2))", s)
    s = re.sub(r"\\sqrt(\d+)", r"sqrt(\1)", s)
    s = (
        s.replace("\\pi", "pi")
        .replace("\\cdot", "*")
        .replace("\\times", "*")
        .replace("{", "(")
        .replace("}", ")")
    )
    return s.lower()


def _allowed(expr: str) -> bool:
    letters = set(re.sub(r"sqrt|pi", "", expr)) & set("abcdefghijklmnopqrstuvwxyz")
    return (
        len(expr) <= MAX_EXPRESSION
        and bool(_SAFE.match(expr))
        and len(letters) <= 2
        and "^(" not in expr
        and not re.search(r"\^\d\d|\^\d+\^", expr)
    )


def _value(expr: str) -> object | None:
    """`expr` read by sympy (None when it is not an expression skylift lets sympy read)."""
    if not _allowed(expr):
        return None
    from sympy.parsing.sympy_parser import (
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    try:
        return parse_expr(
            expr.replace("^", "**"),
            transformations=(*standard_transformations, implicit_multiplication_application),
            evaluate=True,
        )
    except Exception:  # noqa: BLE001 - sympy raises many kinds for text that is no expression
        return None


def _is_integer(s: str) -> bool:
    return re.fullmatch(r"-?\d+", s) is not None


def _equal_values(given: str, truth: str) -> bool:
    if _is_integer(truth) != _is_integer(given):
        return False  # an integer ground truth needs an integer answer (and the other way round)
    if _FRACTION.match(given) and _FRACTION.match(truth):
        return given == truth  # written-out fractions: the same reduced form
    a, b = _value(_latex_to_python(given)), _value(_latex_to_python(truth))
    if a is None or b is None:
        return False
    import sympy

    try:
        diff = sympy.simplify(sympy.sympify(a) - sympy.sympify(b))
        if diff == 0:
            return True
        number = complex(diff.evalf())
    except Exception:  # noqa: BLE001 - symbols left over, or a value sympy cannot evaluate
        return False
    scale = max(1.0, abs(complex(sympy.sympify(b).evalf())))
    return math.isfinite(number.real) and abs(number) <= 1e-9 * scale


def same_answer(given: str | None, ground_truth: str) -> bool:
    """Whether `given` states `ground_truth` (a ``\\boxed{}`` in either is unwrapped first)."""
    if given is None or not str(ground_truth).strip():
        return False
    truth = str(ground_truth)
    if "\\boxed" in truth or "\\fbox" in truth:
        truth = last_boxed(truth) or truth
    if "\\boxed" in given or "\\fbox" in given:
        boxed = last_boxed(given)
        if boxed is None:
            return False
        given = boxed
    g, t = normalize(given), normalize(truth)
    if not g:
        return False
    if g.lower() == t.lower():
        return True
    return _equal_values(g, t)
