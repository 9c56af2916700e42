"""Which config keys the code reads: a small static analysis of skylift's source (used by
test_config_liveness.py).

A key counts as read when some expression outside ``skylift/config/`` loads it. Expressions are
resolved to schema paths, not matched by attribute name alone (``params.min_p`` on an engine's
``SamplingParams`` is not a read of ``generator.sampling_params.min_p``):

- a name, parameter or class field annotated with a schema class imported from ``skylift.config``
  (or one of its modules) holds every path of that class (``o: OptimizerConfig`` -> both
  optimizers; a field ``alg: AlgorithmConfig`` -> ``self.alg`` in the class's methods);
- ``x = <expr>`` (also tuple assignments and ``a if c else b``) gives ``x`` the paths of ``<expr>``
  inside one function; ``self.x = <expr>`` gives them to ``self.x`` in every method of the class;
- ``<expr>.field`` and ``getattr(<expr>, "field")`` extend the paths of ``<expr>`` by ``field``;
  ``getattr(<expr>, name)`` where ``name`` loops over string constants extends by each of them;
- a method of a schema class reads ``self.<field>`` of its own paths (``TrainerConfig.loggers``);
- a name annotated with a ``typing.Protocol`` defined in the sources (the layers below
  ``skylift.config`` declare what they read of a group so, e.g. ``PolicyLossSettings``) holds the
  paths of every schema class that has all the protocol's members (its annotated attributes,
  properties and methods): at run time such an object is the config's group;
- ``register_rollout_plugin("<group>", ...)`` reads the leaf ``environment.<group>``, which
  ``skylift.generator.plugins.rollout_plugin`` hands to that plugin.
"""

from __future__ import annotations

import ast
import dataclasses
import typing
from collections.abc import Iterable
from pathlib import Path

SCHEMA_PACKAGE = "skylift.config"  # schema classes are imported from it or its modules
LOADERS = ("load_config", "default_config")  # they return the root of the tree

Paths = frozenset[str]
_EMPTY: Paths = frozenset()


@dataclasses.dataclass(frozen=True)
class Schema:
    """The key tree of a root dataclass: leaf keys, group keys, and the paths of every group class."""

    root: str  # the root class's name
    leaves: frozenset[str]
    groups: frozenset[str]
    class_paths: dict[str, Paths]  # class name -> paths holding an instance of it (or of a subclass)
    class_members: dict[str, frozenset[str]]  # class name -> its fields and public attributes

    @classmethod
    def of(cls, root: type) -> Schema:
        leaves: set[str] = set()
        groups: set[str] = set()
        held: dict[type, set[str]] = {root: {""}}

        def walk(tp: type, prefix: str) -> None:
            hints = typing.get_type_hints(tp)
            for f in dataclasses.fields(tp):
                key = f"{prefix}{f.name}"
                sub = hints[f.name]
                if isinstance(sub, type) and dataclasses.is_dataclass(sub):
                    groups.add(key)
                    held.setdefault(sub, set()).add(key)
                    walk(sub, key + ".")
                else:
                    leaves.add(key)

        walk(root, "")
        class_paths: dict[str, Paths] = {}
        class_members: dict[str, frozenset[str]] = {}
        for tp in held:
            paths = {p for sub, ps in held.items() if issubclass(sub, tp) for p in ps}
            class_paths[tp.__name__] = frozenset(paths)
            fields = {f.name for f in dataclasses.fields(tp)}
            class_members[tp.__name__] = frozenset(fields | {n for n in dir(tp) if not n.startswith("_")})
        return cls(root.__name__, frozenset(leaves), frozenset(groups), class_paths, class_members)

    def protocol_paths(self, members: frozenset[str]) -> Paths:
        """The paths of every schema class having all of `members` (a protocol's)."""
        out: set[str] = set()
        for name, has in self.class_members.items():
            if members <= has:
                out |= self.class_paths[name]
        return frozenset(out)

    def child(self, parents: Paths, name: str) -> Paths:
        out = set()
        for parent in parents:
            key = f"{parent}.{name}" if parent else name
            if key in self.leaves or key in self.groups:
                out.add(key)
        return frozenset(out)


def read_keys(
    schema: Schema, sources: Iterable[tuple[str, str]], schema_source: str | None = None
) -> set[str]:
    """Leaf keys loaded anywhere in ``sources`` (pairs of file name, Python source).

    ``schema_source``: the text of the module defining the schema classes; a call of one of their
    methods (``t.policy_world_size()``) reads what that method reads of its instance.
    """
    methods: dict[str, set[str]] = {}
    if schema_source is not None:
        tree = ast.parse(schema_source)
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in schema.class_paths):
            for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
                reads: set[str] = set()
                _Module(schema, tree, reads, {}).function(fn, {}, {}, schema.class_paths[cls.name])
                methods.setdefault(fn.name, set()).update(reads)
    trees = [ast.parse(text, filename=name) for name, text in sources]
    protocols: dict[str, Paths] = {}
    for tree in trees:
        for node in ast.walk(tree):
            members = _protocol_members(node)
            if members and (paths := schema.protocol_paths(members)):
                assert isinstance(node, ast.ClassDef)
                protocols[node.name] = paths
    found: set[str] = set()
    for tree in trees:
        _Module(schema, tree, found, methods, protocols).run()
    return found


def _protocol_members(node: ast.AST) -> frozenset[str]:
    """The members of a ``class X(Protocol)`` (annotated names and functions), else nothing."""
    if not isinstance(node, ast.ClassDef):
        return frozenset()
    bases = {
        b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
        for b in node.bases
    }
    if "Protocol" not in bases:
        return frozenset()
    members = set()
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            members.add(stmt.target.id)
        elif isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef) and not stmt.name.startswith("__"):
            members.add(stmt.name)
    return frozenset(members)


def package_sources(package_dir: Path, exclude: Iterable[str] = ()) -> list[tuple[str, str]]:
    """(relative path, text) of every ``.py`` file under ``package_dir`` but the excluded subfolders."""
    excluded = tuple(exclude)
    out = []
    for path in sorted(package_dir.rglob("*.py")):
        rel = path.relative_to(package_dir).as_posix()
        if not rel.startswith(excluded):
            out.append((rel, path.read_text()))
    return out


def _rollout_plugin_group(node: ast.AST) -> str | None:
    """The group of a ``register_rollout_plugin("<group>", plugin)`` call, else None."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args):
        return None
    first = node.args[0]
    if node.func.id != "register_rollout_plugin" or not isinstance(first, ast.Constant):
        return None
    return first.value if isinstance(first.value, str) else None


class _Module:
    def __init__(
        self,
        schema: Schema,
        tree: ast.Module,
        found: set[str],
        methods: dict[str, set[str]],
        protocols: dict[str, Paths] | None = None,
    ) -> None:
        self.schema = schema
        self.methods = methods
        self.protocols = protocols or {}  # protocol name -> paths of the schema classes matching it
        self.tree = tree
        self.found = found
        self.classes: dict[str, str] = {}  # local name -> schema class name
        self.loaders: set[str] = set()  # local names of functions returning a whole config
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module is not None:
                for alias in node.names:
                    if node.module.startswith(SCHEMA_PACKAGE) and alias.name in schema.class_paths:
                        self.classes[alias.asname or alias.name] = alias.name
                    elif node.module.startswith("skylift.config") and alias.name in LOADERS:
                        self.loaders.add(alias.asname or alias.name)
            group = _rollout_plugin_group(node)
            if group is not None and f"environment.{group}" in schema.leaves:
                found.add(f"environment.{group}")

    def run(self) -> None:
        self._body(self.tree.body, {}, {})

    def _body(self, body: list[ast.stmt], env: dict[str, Paths], attrs: dict[str, Paths]) -> None:
        """A module's or function's statements, then the functions and classes defined in them."""
        self._scope(body, env, attrs)
        for stmt in body:
            for node in _definitions(stmt):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    self.function(node, env, attrs, _EMPTY)
                elif isinstance(node, ast.ClassDef):
                    self._class(node)

    def _class(self, node: ast.ClassDef) -> None:
        own = self.schema.class_paths.get(node.name, _EMPTY)
        attrs: dict[str, Paths] = {}
        for stmt in node.body:  # a (data)class field annotated with a schema class: `self.<field>`
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                if paths := self._annotation(stmt.annotation):
                    attrs[stmt.target.id] = paths
        methods = [n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        for _ in range(2):  # `self.x = ...` in one method may be read in an earlier one
            for method in methods:
                self.function(method, {}, attrs, own)

    def function(
        self,
        fn: ast.FunctionDef | ast.AsyncFunctionDef,
        outer: dict[str, Paths],
        attrs: dict[str, Paths],
        own: Paths,
    ) -> None:
        env = dict(outer)  # closures see the enclosing function's names
        args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
        for i, arg in enumerate(args):
            env[arg.arg] = own if (i == 0 and own and arg.arg == "self") else self._annotation(arg.annotation)
        self._body(fn.body, env, attrs)

    def _scope(self, body: list[ast.stmt], env: dict[str, Paths], attrs: dict[str, Paths]) -> None:
        loops: dict[str, list[str]] = {}
        for stmt in body:
            for node in _walk_scope(stmt):
                if isinstance(node, ast.For | ast.comprehension) and isinstance(node.target, ast.Name):
                    names = _string_constants(node.iter)
                    if names:
                        loops[node.target.id] = names
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    env[node.target.id] = self._annotation(node.annotation)
                    if node.value is not None:
                        self._assign(node.target, node.value, env, attrs, loops)
                elif isinstance(node, ast.Assign):
                    for target in node.targets:
                        self._assign(target, node.value, env, attrs, loops)
                elif isinstance(node, ast.NamedExpr):
                    self._assign(node.target, node.value, env, attrs, loops)
            for node in _walk_scope(stmt):
                if isinstance(node, ast.Attribute | ast.Call) and not _is_store(node):
                    for key in self._paths(node, env, attrs, loops):
                        if key in self.schema.leaves:
                            self.found.add(key)

    def _assign(
        self,
        target: ast.expr,
        value: ast.expr,
        env: dict[str, Paths],
        attrs: dict[str, Paths],
        loops: dict[str, list[str]],
    ) -> None:
        if isinstance(target, ast.Tuple | ast.List) and isinstance(value, ast.Tuple | ast.List):
            for t, v in zip(target.elts, value.elts, strict=False):
                self._assign(t, v, env, attrs, loops)
            return
        paths = self._paths(value, env, attrs, loops)
        if isinstance(target, ast.Name):
            if paths:
                env[target.id] = env.get(target.id, _EMPTY) | paths
        elif _is_self_attr(target) and paths:
            assert isinstance(target, ast.Attribute)
            attrs[target.attr] = attrs.get(target.attr, _EMPTY) | paths

    def _paths(
        self, node: ast.expr, env: dict[str, Paths], attrs: dict[str, Paths], loops: dict[str, list[str]]
    ) -> Paths:
        if isinstance(node, ast.Name):
            return env.get(node.id, _EMPTY)
        if isinstance(node, ast.Attribute):
            if _is_self_attr(node) and node.attr in attrs:
                return attrs[node.attr] | self.schema.child(env.get("self", _EMPTY), node.attr)
            return self.schema.child(self._paths(node.value, env, attrs, loops), node.attr)
        if isinstance(node, ast.IfExp):
            return self._paths(node.body, env, attrs, loops) | self._paths(node.orelse, env, attrs, loops)
        if isinstance(node, ast.BoolOp):
            out: Paths = _EMPTY
            for v in node.values:
                out |= self._paths(v, env, attrs, loops)
            return out
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in self.methods
        ):
            base = self._paths(node.func.value, env, attrs, loops)
            return frozenset(
                k for k in self.methods[node.func.attr] if any(k.startswith(p + ".") for p in base)
            )
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in self.loaders:
            return self.schema.class_paths[self.schema.root]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
            if len(node.args) < 2:
                return _EMPTY
            base = self._paths(node.args[0], env, attrs, loops)
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                return self.schema.child(base, name.value)
            if isinstance(name, ast.Name) and name.id in loops:
                out = _EMPTY
                for n in loops[name.id]:
                    out |= self.schema.child(base, n)
                return out
        return _EMPTY

    def _annotation(self, node: ast.expr | None) -> Paths:
        if node is None:
            return _EMPTY
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                node = ast.parse(node.value, mode="eval").body
            except SyntaxError:
                return _EMPTY
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            return self._annotation(node.left) | self._annotation(node.right)
        if isinstance(node, ast.Name) and node.id in self.classes:
            return self.schema.class_paths[self.classes[node.id]]
        if isinstance(node, ast.Name) and node.id in self.protocols:
            return self.protocols[node.id]
        return _EMPTY


def _walk_scope(node: ast.AST) -> Iterable[ast.AST]:
    """The nodes of one statement, leaving out functions and classes defined in it."""
    if isinstance(node, _DEFINITIONS):
        return
    yield node
    for child in ast.iter_child_nodes(node):
        yield from _walk_scope(child)


def _definitions(node: ast.AST) -> Iterable[ast.AST]:
    """The functions and classes defined in one statement (not those nested in them)."""
    if isinstance(node, _DEFINITIONS):
        yield node
        return
    for child in ast.iter_child_nodes(node):
        yield from _definitions(child)


_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _is_store(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store | ast.Del)


def _is_self_attr(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"


def _string_constants(node: ast.expr) -> list[str]:
    if isinstance(node, ast.Tuple | ast.List | ast.Set) and node.elts:
        if all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
            return [e.value for e in node.elts]  # type: ignore[union-attr]
    return []
