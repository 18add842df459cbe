"""The mutants of ``tools/mutation.py``: a small AST mutator and the id of each change.

Split out of the runner so that each stays one concern: this module only enumerates, it runs
nothing.
"""

from __future__ import annotations

import ast
import copy
import hashlib
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Mutant", "mutants_of"]

# Functions that only build human-readable text.
SKIP_FUNCTIONS = frozenset({"__repr__", "__str__", "_who", "describe"})
CMP_SWAPS: dict[type, tuple[type, ...]] = {
    ast.Lt: (ast.LtE,), ast.LtE: (ast.Lt,), ast.Gt: (ast.GtE,), ast.GtE: (ast.Gt,),
    ast.Eq: (ast.NotEq,), ast.NotEq: (ast.Eq,), ast.In: (ast.NotIn,), ast.NotIn: (ast.In,),
    ast.Is: (ast.IsNot,), ast.IsNot: (ast.Is,),
}
BIN_SWAPS: dict[type, type] = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv,
                               ast.FloorDiv: ast.Mult, ast.Mod: ast.FloorDiv}
NEGATED_BY_CMP = (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)


# ------------------------------------------------------------------------------- enumeration
@dataclass(frozen=True)
class Mutant:
    """One change of one module: the source span and its replacement."""

    module: str  # path relative to the repository, e.g. lw/fsm/prefill.py
    line: int
    col: int
    end_line: int
    end_col: int
    op: str
    original: str
    replacement: str
    function: str  # enclosing function ("" at module or class level)
    nth: int = 0  # how many earlier mutants of this function have the same op/original/replacement

    @property
    def id(self) -> str:
        """Stable across edits elsewhere in the module (no line number): module, function,
        operator, original and replacement text, and the occurrence among equal ones."""
        key = "\0".join((self.module, self.function, self.op, " ".join(self.original.split()),
                          self.replacement, str(self.nth)))
        stem = Path(self.module).stem
        return f"{stem}.{self.function or '-'}.{hashlib.sha256(key.encode()).hexdigest()[:8]}"

    @property
    def where(self) -> str:
        return f"{self.module}:{self.line}"

    def describe(self) -> str:
        """One line: file:line [operator] original -> mutant."""
        def short(s: str) -> str:
            s = " ".join(s.split())
            return s if len(s) <= 70 else s[:67] + "..."
        fn = f" in {self.function}" if self.function else ""
        return f"{self.where}{fn} [{self.op}] {short(self.original)} -> {short(self.replacement)}"


def _is_docstring(stmt: ast.stmt) -> bool:
    return (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
            and isinstance(stmt.value.value, str))


def _is_counter(stmt: ast.stmt) -> bool:
    """``self.counters = {...}`` or ``self.counters[...] += 1``: statistics, not protocol."""
    if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        return any(isinstance(t, ast.Attribute) and t.attr == "counters" for t in targets)
    return (isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Subscript)
            and isinstance(stmt.target.value, ast.Attribute)
            and stmt.target.value.attr == "counters")


class _Finder:
    """Walks one module's AST and yields (node, operator, replacement node or text)."""

    def __init__(self) -> None:
        self.found: list[tuple[ast.AST, str, str, str]] = []  # node, op, replacement, function

    def add(self, node: ast.AST, op: str, new: ast.AST | str, fn: str) -> None:
        text = new if isinstance(new, str) else ast.unparse(new)
        self.found.append((node, op, text, fn))

    def visit_body(self, body: list[ast.stmt], fn: str, in_class: bool) -> None:
        for stmt in body:
            if _is_docstring(stmt):
                continue
            self.visit_stmt(stmt, fn, in_class)

    def visit_stmt(self, stmt: ast.stmt, fn: str, in_class: bool) -> None:
        if isinstance(stmt, (ast.Import, ast.ImportFrom, ast.Assert, ast.Pass, ast.Global,
                             ast.Nonlocal)):
            return
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if stmt.name in SKIP_FUNCTIONS:
                return
            for d in (*stmt.args.defaults, *[d for d in stmt.args.kw_defaults if d]):
                self.visit_expr(d, fn)  # evaluated where the function is defined
            self.visit_body(stmt.body, stmt.name, False)
            return
        if isinstance(stmt, ast.ClassDef):
            if stmt.name.endswith("Config"):
                # Tuning defaults (retry periods, budgets) are not protocol; the checks in
                # __post_init__ are.
                self.visit_body([s for s in stmt.body if not isinstance(s, ast.AnnAssign)], fn,
                                True)
            else:
                self.visit_body(stmt.body, fn, True)
            return
        if isinstance(stmt, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in stmt.targets):
            return
        if _is_counter(stmt):
            return
        if fn:
            self.deletions(stmt, fn)
        if isinstance(stmt, ast.AugAssign) and type(stmt.op) in (ast.Add, ast.Sub):
            new = copy.copy(stmt)
            new.op = ast.Sub() if isinstance(stmt.op, ast.Add) else ast.Add()
            self.add(stmt, "augassign", new, fn)
        if isinstance(stmt, (ast.If, ast.While)):
            self.negate(stmt.test, fn)
        for name, value in ast.iter_fields(stmt):
            if name in ("annotation", "returns", "decorator_list", "type_comment", "target",
                        "targets"):
                if name in ("target", "targets"):
                    for t in value if isinstance(value, list) else [value]:
                        if isinstance(t, ast.Subscript):
                            self.visit_expr(t.slice, fn)
                continue
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                self.visit_body(value, fn, in_class)
            elif isinstance(value, list):
                for v in value:
                    if isinstance(v, ast.expr):
                        self.visit_expr(v, fn)
                    elif isinstance(v, ast.excepthandler):
                        self.visit_body(v.body, fn, in_class)
                    elif isinstance(v, ast.withitem):
                        self.visit_expr(v.context_expr, fn)
            elif isinstance(value, ast.expr):
                self.visit_expr(value, fn)

    def deletions(self, stmt: ast.stmt, fn: str) -> None:
        if fn in ("__init__", "__post_init__") and isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            return  # deleting an attribute's initialisation only raises AttributeError
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
            self.add(stmt, "delete", "pass", fn)
        elif isinstance(stmt, (ast.Assign, ast.AugAssign)) and any(
                isinstance(t, (ast.Attribute, ast.Subscript))
                for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target])):
            self.add(stmt, "delete", "pass", fn)
        elif isinstance(stmt, (ast.Delete, ast.Raise)):
            self.add(stmt, "delete", "pass", fn)
        elif isinstance(stmt, ast.Return) and stmt.value is not None and not (
                isinstance(stmt.value, ast.Constant) and stmt.value.value is None):
            self.add(stmt, "return-none", "return None", fn)

    def negate(self, test: ast.expr, fn: str) -> None:
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            return  # "not" removal covers it
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(
                test.ops[0], NEGATED_BY_CMP):
            return  # the comparison swap covers it
        self.add(test, "negate", ast.UnaryOp(ast.Not(), test), fn)

    def visit_expr(self, node: ast.expr, fn: str) -> None:
        if isinstance(node, ast.JoinedStr):
            return  # message text
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and \
                node.value.id == "Annotated":
            return  # a type with wire bounds: a type annotation
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                for new_op in CMP_SWAPS.get(type(op), ()):
                    new = copy.copy(node)
                    new.ops = [*node.ops[:i], new_op(), *node.ops[i + 1:]]
                    self.add(node, "compare", new, fn)
        elif isinstance(node, ast.BoolOp):
            new = copy.copy(node)
            new.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
            self.add(node, "boolop", new, fn)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            self.add(node, "not-removed", node.operand, fn)
        elif isinstance(node, ast.IfExp):
            self.negate(node.test, fn)
        elif isinstance(node, ast.BinOp) and type(node.op) in BIN_SWAPS:
            new = copy.copy(node)
            new.op = BIN_SWAPS[type(node.op)]()
            self.add(node, "arith", new, fn)
        elif isinstance(node, ast.Constant):
            v = node.value
            if isinstance(v, bool):
                self.add(node, "constant", repr(not v), fn)
            elif isinstance(v, int):
                self.add(node, "constant", repr(v + 1), fn)
                if v != 0:
                    self.add(node, "constant", repr(v - 1), fn)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr):
                self.visit_expr(child, fn)
            elif isinstance(child, ast.comprehension):
                for e in (child.iter, *child.ifs):
                    self.visit_expr(e, fn)
            elif isinstance(child, ast.keyword):
                self.visit_expr(child.value, fn)
            elif isinstance(child, ast.arguments):
                pass


def _splice(src: bytes, line_starts: list[int], node: ast.AST, text: str) -> bytes:
    start = line_starts[node.lineno - 1] + node.col_offset  # type: ignore[attr-defined]
    end = line_starts[node.end_lineno - 1] + node.end_col_offset  # type: ignore[attr-defined]
    if isinstance(node, ast.expr):
        text = f"({text})"
    return src[:start] + text.encode() + src[end:]


def mutants_of(module: str, source: str) -> list[tuple[Mutant, str]]:
    """Every distinct, compilable mutant of one module, with its mutated source."""
    raw = source.encode()
    line_starts = [0]
    for line in raw.splitlines(keepends=True):
        line_starts.append(line_starts[-1] + len(line))
    tree = ast.parse(source)
    finder = _Finder()
    finder.visit_body(tree.body, "", False)
    base = ast.dump(tree)
    seen = {base}
    out: list[tuple[Mutant, str]] = []
    occurrences: dict[tuple[str, str, str, str], int] = {}
    for node, op, text, fn in finder.found:
        try:
            mutated = _splice(raw, line_starts, node, text).decode()
            dump = ast.dump(ast.parse(mutated))
        except SyntaxError:
            continue
        if dump in seen:
            continue
        seen.add(dump)
        original = raw[line_starts[node.lineno - 1] + node.col_offset:  # type: ignore[attr-defined]
                       line_starts[node.end_lineno - 1] + node.end_col_offset].decode()  # type: ignore[attr-defined]
        same = (fn, op, " ".join(original.split()), text)
        nth = occurrences.get(same, 0)
        occurrences[same] = nth + 1
        out.append((Mutant(module, node.lineno, node.col_offset,  # type: ignore[attr-defined]
                           node.end_lineno, node.end_col_offset,  # type: ignore[attr-defined]
                           op, original, text, fn, nth), mutated))
    return out
