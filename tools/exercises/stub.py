"""Stubbing a function in place: the body goes, the signature, decorators and docstring stay.

    def slot(self, seq_id, position):                  def slot(self, seq_id, position):
        \"\"\"The pool slot of a sequence's token.\"\"\"   ──►     \"\"\"The pool slot of a sequence's token.\"\"\"
        table = self.block_tables[seq_id]                  raise NotImplementedError("exercise 07: ...")
        ...

`ast` finds the function (`name` or `Class.method`) and the line range of its body; only those lines
are rewritten, so every other byte of the file stays as it was and `git diff` shows exactly the stubs.
Comments inside the body go with it (they often say how it is done). A generator stays a generator
(an unreachable `yield` after the raise), so a caller fails on the stub, not on a changed kind.
"""

from __future__ import annotations

import ast
import io
import json
import textwrap
import tokenize

Function = ast.FunctionDef | ast.AsyncFunctionDef


def find_function(tree: ast.Module, name: str) -> Function:
    """`f` or `Class.method` (classes may nest) at module level."""
    scope: list[ast.stmt] = tree.body
    *outer, last = name.split(".")
    for part in outer:
        cls = next((n for n in scope if isinstance(n, ast.ClassDef) and n.name == part), None)
        if cls is None:
            raise LookupError(f"no class {part!r} for {name!r}")
        scope = cls.body
    fn = next((n for n in scope if isinstance(n, Function) and n.name == last), None)
    if fn is None:
        raise LookupError(f"no function {name!r}")
    return fn


def _header_end(lines: list[str], fn: Function) -> int:
    """The line (1-based) of the `:` that ends the `def` header; the signature may span lines."""
    depth = 0
    for tok in tokenize.generate_tokens(io.StringIO("".join(lines[fn.lineno - 1 :])).readline):
        if tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
        elif tok.type == tokenize.OP and tok.string == ":" and depth == 0:
            return fn.lineno + tok.start[0] - 1
    raise ValueError(f"no end of the header of {fn.name!r}")


def _end(lines: list[str], fn: Function) -> int:
    """The last line (1-based) of `fn`, counting comments after its last statement indented as its body."""
    end, indent = fn.end_lineno, " " * fn.body[-1].col_offset
    while end < len(lines) and lines[end].strip().startswith("#") and lines[end].startswith(indent):
        end += 1
    return end


def _is_generator(fn: Function) -> bool:
    """Does `fn` itself (not a function nested in it) yield?"""
    todo: list[ast.AST] = list(fn.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Yield | ast.YieldFrom):
            return True
        if not isinstance(node, Function | ast.Lambda | ast.ClassDef):
            todo.extend(ast.iter_child_nodes(node))
    return False


def _raise_lines(message: str, indent: str, generator: bool) -> list[str]:
    """`raise NotImplementedError("...")`, wrapped to stay within 120 columns."""
    one = f'{indent}raise NotImplementedError("{message}")\n'
    if len(one) <= 120:
        out = [one]
    else:
        parts = textwrap.wrap(message, 110 - len(indent), drop_whitespace=False)
        out = [f"{indent}raise NotImplementedError(\n", *(f"{indent}    {json.dumps(p)}\n" for p in parts)]
        out.append(f"{indent})\n")
    if generator:
        out.append(f"{indent}yield  # (unreachable: keeps this function a generator)\n")
    return out


def stub_source(source: str, name: str, message: str) -> str:
    """`source` with the body of function `name` replaced by `raise NotImplementedError(message)`."""
    if '"' in message or "\\" in message:
        raise ValueError(f"a hint may not contain double quotes or backslashes: {message!r}")
    lines = source.splitlines(keepends=True)
    fn = find_function(ast.parse(source), name)
    first_stmt = fn.body[0]
    doc = isinstance(first_stmt, ast.Expr) and isinstance(first_stmt.value, ast.Constant)
    doc = doc and isinstance(first_stmt.value.value, str)
    header = _header_end(lines, fn)
    if first_stmt.lineno == header:
        raise ValueError(f"{name}: a one-line function (its body on the `def` line) cannot be stubbed")
    first = first_stmt.end_lineno + 1 if doc else header + 1  # 1-based: the first line to replace
    last = _end(lines, fn)  # 1-based: the last line to replace (before a docstring-only body's end: none)
    stub = _raise_lines(message, " " * first_stmt.col_offset, _is_generator(fn))
    return "".join(lines[: first - 1] + stub + lines[max(last, first - 1) :])


def is_stubbed(source: str, name: str, nn: str) -> bool:
    """Does function `name` still raise exercise `nn`'s NotImplementedError?"""
    for node in ast.walk(find_function(ast.parse(source), name)):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
            func, arg = node.exc.func, node.exc.args[0]
            text = arg.value if isinstance(arg, ast.Constant) else ""
            if getattr(func, "id", "") == "NotImplementedError" and str(text).startswith(f"exercise {nn}:"):
                return True
    return False


def function_lines(source: str, name: str) -> tuple[int, int]:
    """0-based [start, end) line range of function `name`, with its decorators and trailing comments."""
    fn = find_function(ast.parse(source), name)
    start = min([fn.lineno, *(d.lineno for d in fn.decorator_list)]) - 1
    return start, _end(source.splitlines(keepends=True), fn)


def replace_function(source: str, original: str, name: str) -> str:
    """`source` with function `name` as it is in `original`; every other line as it is in `source`."""
    a, b = function_lines(source, name)
    c, d = function_lines(original, name)
    lines, orig = source.splitlines(keepends=True), original.splitlines(keepends=True)
    return "".join(lines[:a] + orig[c:d] + lines[b:])
