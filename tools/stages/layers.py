"""The house rules of roseinfer/, checked on the source: `python -m tools.stages.layers [--trace-step]`.

Prints the packages of roseinfer/ by layer (each imports only from the layers below it), then checks:

  layers      a package imports nothing from a layer above it (entrypoints > engine > worker > core ...)
              (the files of UPWARD_IMPORTS excepted, each for the modules it lists and the reason given)
  cycles      no two modules import each other, directly or around a loop (imports at module level)
  the door    nothing outside roseinfer/core/ and roseinfer/engine/core.py imports the scheduler or the KV
              cache manager; nothing outside roseinfer/worker/ imports the model runner; nothing in front
              of the core (engine/, entrypoints/) reads `.scheduler`, `.kv_cache_manager` or `.model_runner`,
              and the programs beside the package (examples, benchmarks, tools, scripts, notebooks) look inside
              the core only through the in-process core, `llm_engine.engine_core.engine_core`
  size        no module of roseinfer/ over 400 lines

With --trace-step it also runs one decode step of the bundled model under `sys.setprofile` and lists the
modules of roseinfer/ that the step calls into. Exits 1 if a rule is broken.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "roseinfer"
LAYERS = {  # package -> layer: a package may import from its own layer and the layers below
    "entrypoints": 5,
    "engine": 4,
    "worker": 3,
    "spec_decode": 3,
    "sample": 2,
    "core": 2,
    "structured_output": 2,
    "model_executor": 1,
    "attention": 0,
    "tokenizer": 0,
}
UPWARD_IMPORTS = {  # file -> the modules of a higher layer it may import, and why
    # the table of every Triton kernel for tools/triton_aot.py: it lists model_executor's fused-op and W8A8
    # kernels too; the engine never imports it
    "roseinfer/attention/triton_registry.py": (
        "roseinfer.model_executor",
        "roseinfer.model_executor.triton_ops",
        "roseinfer.model_executor.quantization",
        "roseinfer.model_executor.quantization.triton_int8",
    ),
}
CORE_PARTS = {"scheduler", "kv_cache_manager", "model_runner"}
IMPORT_RULES = {  # module -> the folders (or files) that may import it
    "roseinfer.core.sched.scheduler": ("roseinfer/core/", "roseinfer/engine/core.py"),
    "roseinfer.core.kv_cache_manager": ("roseinfer/core/", "roseinfer/engine/core.py"),
    "roseinfer.worker.model_runner": ("roseinfer/worker/", "roseinfer/spec_decode/"),  # proposers run in the worker
    "roseinfer.worker.tp_worker": ("roseinfer/worker/", "benchmarks/engine/measure_tensor_parallel.py"),
}  # (chapter 15's measurement times the tensor-parallel runner's broadcast by wrapping it)
FRONT = ("roseinfer/engine/", "roseinfer/entrypoints/", "roseinfer/outputs.py", "roseinfer/__init__.py")
THE_CORE = ("roseinfer/engine/core.py",)
PROGRAMS = ("examples", "benchmarks", "tools", "scripts", "notebooks")
MAX_LINES = 400


def python_files(*folders: str) -> list[Path]:
    return sorted(p for f in folders if (REPO / f).is_dir() for p in (REPO / f).rglob("*.py") if ".venv" not in p.parts)


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(tree: ast.AST, top_level_only: bool = False) -> list[str]:
    """Every module an import names: `from a.b import c` gives a.b and a.b.c (c may be a module)."""
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def check_layers() -> list[str]:
    problems = []
    for path in python_files("roseinfer"):
        parts = path.relative_to(PACKAGE).parts
        if len(parts) < 2 or parts[0] not in LAYERS:
            continue
        for name in imports(ast.parse(path.read_text())):
            target = name.split(".")[1] if name.startswith("roseinfer.") else None
            if name in UPWARD_IMPORTS.get(rel(path), ()):
                continue
            if target in LAYERS and target != parts[0] and LAYERS[target] > LAYERS[parts[0]]:
                problems.append(f"layers: {rel(path)} imports {name} (layer {LAYERS[target]} > {LAYERS[parts[0]]})")
    return sorted(set(problems))


def check_cycles() -> list[str]:
    """Module-level imports between roseinfer's modules, searched for a loop (depth-first, three colours)."""
    modules = {module_name(p): p for p in python_files("roseinfer")}
    graph = {
        m: sorted({n for n in imports(ast.parse(p.read_text()), top_level_only=True) if n in modules and n != m})
        for m, p in modules.items()
    }
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    problems = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in graph[m]:
            if state.get(n) == 1:
                problems.append("cycle: " + " -> ".join(path[path.index(n) :] + [n]))
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return problems


def reaches_in(node: ast.AST) -> bool:
    """`x.scheduler` (or `.kv_cache_manager`, `.model_runner`), unless x is the in-process core:
    `... .engine_core.engine_core` or a name `core`."""
    if not (isinstance(node, ast.Attribute) and node.attr in CORE_PARTS):
        return False
    base = node.value
    if isinstance(base, ast.Name):
        return base.id != "core"
    inner = base.value if isinstance(base, ast.Attribute) else None
    return not (
        isinstance(base, ast.Attribute) and base.attr == "engine_core" and getattr(inner, "attr", "") == "engine_core"
    )


def check_the_door() -> list[str]:
    problems = []
    for path in python_files("roseinfer", *PROGRAMS):
        for name in imports(ast.parse(path.read_text())):
            for module, allowed in IMPORT_RULES.items():
                if (name == module or name.startswith(module + ".")) and not rel(path).startswith(allowed):
                    problems.append(f"the door: {rel(path)} imports {module} (only {', '.join(allowed)} may)")
    for path in python_files("roseinfer"):
        if rel(path).startswith(FRONT) and rel(path) not in THE_CORE:
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr in CORE_PARTS:
                    problems.append(f"the door: {rel(path)}:{node.lineno} reads .{node.attr}")
    for path in python_files(*PROGRAMS):
        for node in ast.walk(ast.parse(path.read_text())):
            if reaches_in(node):
                problems.append(f"the door: {rel(path)}:{node.lineno} reads .{node.attr} outside the in-process core")
    return sorted(set(problems))


def check_sizes() -> list[str]:
    return [
        f"size: {rel(p)} has {n} lines (at most {MAX_LINES})"
        for p in python_files("roseinfer")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    ]


def check() -> list[str]:
    return check_layers() + check_cycles() + check_the_door() + check_sizes()


def trace_decode_step() -> Counter:
    """The modules of roseinfer/ one decode step of two requests calls into (bundled model, CPU)."""
    from roseinfer import LLMEngine, SamplingParams

    eng = LLMEngine(device="cpu")
    for rid, prompt in (("a", "Romeo.\n"), ("b", "Juliet.\n")):
        eng.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=8))
    for _ in range(3):
        eng.step()  # the prefill, then decode steps
    calls: Counter = Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(str(PACKAGE)):
            calls[Path(frame.f_code.co_filename).relative_to(PACKAGE).as_posix()] += 1

    sys.setprofile(profile)
    try:
        eng.step()
    finally:
        sys.setprofile(None)
    return calls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace-step", action="store_true", help="also list the modules one decode step calls into")
    args = ap.parse_args(argv)
    by_layer: dict[int, list[str]] = {}
    for package, layer in LAYERS.items():
        by_layer.setdefault(layer, []).append(package)
    for layer in sorted(by_layer, reverse=True):
        print(f"layer {layer}: {', '.join(by_layer[layer])}")
    if args.trace_step:
        calls = trace_decode_step()
        folders = {m.split("/")[0] for m in calls if "/" in m}
        print(f"\none decode step calls into {len(calls)} modules in {len(folders)} folders:")
        for module, n in sorted(calls.items()):
            print(f"  {n:4d} calls  {module}")
    problems = check()
    print(
        "\n" + ("\n".join(problems) if problems else "no layer broken, no cycle, no reach-in, no module over 400 lines")
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
