"""The code's layering, read from the import statements (module level and inside functions) with `ast`.

    text -> data -> (models) -> train -> embed -> cli        utils.py, workers.py, compiled.py below all of them

- `models/` imports nothing of text/data/train/embed;
- `text/` nothing of data/models/train/embed; `data/` nothing of models/train/embed;
- `train/` never imports `embed/`, and `embed/` never imports `train/`;
- no module imports another module's `_private` name (and no test imports one); no import cycle between files.

`python tests/test_layout.py` prints the import graph between kbert's folders.
"""

import ast
import collections
import os

KBERT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kbert")
FOLDERS = ("text", "data", "models", "train", "embed")
ALLOWED = {  # the layers each layer may import
    "base": {"base"},
    "text": {"base", "text"},
    "data": {"base", "text", "data"},
    "models": {"base", "models"},
    "train": {"base", "text", "data", "models", "train"},
    "embed": {"base", "text", "data", "models", "embed"},
    "top": {"base", "text", "data", "models", "train", "embed", "top"},
}


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in FOLDERS:
        return parts[1]
    if len(parts) > 1 and parts[1] in ("utils", "workers", "compiled"):
        return "base"
    return "top"  # cli.py, quickstart.py, the package's lazy __init__.py


def modules():
    """{module name: file path} for every kbert source file."""
    out = {}
    root = os.path.dirname(os.path.abspath(KBERT))
    for folder, _, files in os.walk(KBERT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def imports(path, known):
    """(imported kbert module, imported name or None, line) for each kbert import in the file."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "kbert"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kbert":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if sub in known:  # `from kbert.train import faults`: the module itself
                    found.append((sub, None, node.lineno))
                else:
                    found.append((node.module, a.name, node.lineno))
    return found


def graph():
    known = modules()
    edges = collections.defaultdict(set)
    problems = []
    for module, path in sorted(known.items()):
        for target, name, line in imports(path, known):
            where = f"{os.path.relpath(path, os.path.dirname(KBERT))}:{line}"
            if layer_of(target) not in ALLOWED[layer_of(module)]:
                problems.append(f"{where}: {layer_of(module)} imports {layer_of(target)} ({target})")
            if name is not None and name.startswith("_") and target != module:
                problems.append(f"{where}: imports the private name {name} of {target}")
            if target != module and target in known and not known[target].endswith("__init__.py"):
                edges[module].add(target)
    return edges, problems


def cycles(edges):
    """Every import cycle between files (each as a list of modules), by depth-first search."""
    found, state, stack = [], {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node)
    return found


def test_imports_run_one_way_with_no_private_names():
    edges, problems = graph()
    assert not problems, "\n".join(problems)


def test_no_import_cycle_between_files():
    edges, _ = graph()
    assert not cycles(edges), cycles(edges)


def test_tests_import_no_private_kbert_names():
    """Tests use kbert's public names (what users get), so internals can change without editing tests."""
    here = os.path.dirname(os.path.abspath(__file__))
    known = modules()
    found = []
    for name in sorted(os.listdir(here)):
        if name.endswith(".py"):
            for target, imported, line in imports(os.path.join(here, name), known):
                if (imported or "").startswith("_") or any(p.startswith("_") for p in target.split(".")[1:]):
                    found.append(f"tests/{name}:{line}: {target} {imported or ''}")
    assert not found, "\n".join(found)


def test_the_checker_sees_a_violation(tmp_path):
    """The rules are live: an upward import and a private name are reported."""
    known = {"kbert.models.x": "x.py", "kbert.embed.embedder": "e.py"}
    bad = tmp_path / "x.py"
    bad.write_text("def f():\n    from kbert.embed.embedder import _text_list\n", encoding="utf-8")
    (target, name, line), = imports(str(bad), known)
    assert (target, name, line) == ("kbert.embed.embedder", "_text_list", 2)
    assert layer_of(target) not in ALLOWED[layer_of("kbert.models.x")]
    assert cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]


if __name__ == "__main__":
    edges, problems = graph()
    folders = collections.Counter((layer_of(a), layer_of(b)) for a, targets in edges.items() for b in targets)
    for (a, b), n in sorted(folders.items()):
        if a != b:
            print(f"{a:7s} -> {b:7s} {n:3d} import(s)")
    print("\n".join(problems) or "no upward import, no private name across modules")
