"""The dependency rule of docs/architecture.md, checked on the source: every import counts (top level,
inside functions, under TYPE_CHECKING)."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Each folder of the checkout is one subpackage of the import root `moechat`.
FOLDERS = {"moechat": "moechat", "app": "moechat.app", "engine": "moechat.engine", "widgets": "moechat.widgets",
           "tuner": "moechat.tuner", "assets": "moechat.assets", "demo": "moechat.demo"}  # fmt: skip

# The engine's layers, lowest first: a module imports only from its own layer or lower ones.
ENGINE_LAYERS: dict[str, int] = {
    "errors": 0,
    "gguf": 0,
    "kernels": 1,
    "config": 2,
    "text": 2,
    "nn": 3,
    "moe": 4,
    "cache": 5,
    "models": 6,
    "serving": 7,  # many requests on one model: beside the runtime it batches
    "distributed": 8,  # a model split over hosts: above the runtime it splits
}
RUNTIME = 7  # the engine's top modules (loader, generate, ...) use everything below
UI_LIBRARIES = ("textual", "rich", "plotext", "textual_plotext", "starlette", "uvicorn", "prometheus_client", "httpx")


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """Every module `name` imports (project modules by their full name, others by their top name)."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                full = f"{source}.{alias.name}"
                yield full if full in known else source


def project_module(target: str, known: dict[str, Path]) -> str | None:
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target or None


def graph() -> dict[str, set[str]]:
    known = modules()
    edges: dict[str, set[str]] = {}
    for name, path in known.items():
        edges[name] = set()
        for target in imports(name, path, known):
            own = project_module(target, known) if target.startswith("moechat") else None
            edges[name].add(own if own is not None else target.split(".")[0])
        edges[name].discard(name)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def engine_layer(module: str) -> int:
    part = module.split(".")[2] if module.count(".") >= 2 else ""
    return ENGINE_LAYERS.get(part, RUNTIME)


def test_the_graph_sees_every_kind_of_import() -> None:
    edges = graph()
    assert len(edges) > 80
    # a function-local import and one under TYPE_CHECKING are both edges
    assert "moechat.engine.kernels.jit" in edges["moechat.engine.loader"]
    assert "moechat.engine.cache.device_memory" in edges["moechat.engine.loader"]


def test_no_import_cycles() -> None:
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def imports_from(package: str, wrong: Callable[[str, str], bool]) -> list[str]:
    """The imports `src -> dst` of the modules under `package` for which wrong(src, dst) holds."""
    return [f"{src} -> {dst}" for src, targets in graph().items() if src.startswith(package)
            for dst in targets if wrong(src, dst)]  # fmt: skip


def test_engine_layers_import_only_downwards() -> None:
    def upward(src: str, dst: str) -> bool:
        return dst.startswith("moechat.engine.") and engine_layer(dst) > engine_layer(src)

    assert imports_from("moechat.engine.", upward) == []


def test_kernels_know_no_model_code() -> None:
    def model_code(src: str, dst: str) -> bool:
        return dst.startswith("moechat.") and not dst.startswith(("moechat.engine.kernels", "moechat.engine.gguf"))

    assert imports_from("moechat.engine.kernels.", model_code) == []


def test_dependencies_point_one_way() -> None:
    """app -> tuner/widgets -> engine: the engine, the tuner and the demo builder import no UI library
    and nothing above them; widgets import no app code."""
    bad = []
    for src, targets in graph().items():
        for dst in targets:
            if src.startswith(("moechat.engine", "moechat.tuner", "moechat.demo")) and (
                dst in UI_LIBRARIES or dst.startswith(("moechat.app", "moechat.widgets"))
            ):
                bad.append(f"{src} -> {dst}")
            if src.startswith("moechat.engine") and dst.startswith(("moechat.tuner", "moechat.demo")):
                bad.append(f"{src} -> {dst}")
            if src.startswith("moechat.widgets") and dst.startswith("moechat.app"):
                bad.append(f"{src} -> {dst}")
    assert bad == []


def test_the_engine_shows_its_parts() -> None:
    engine = ROOT / "engine"
    packages = [p for p in engine.iterdir() if (p / "__init__.py").is_file()]
    top_modules = [p for p in engine.glob("*.py") if p.name != "__init__.py"]
    assert len(packages) >= 5
    assert len(top_modules) <= 8, sorted(p.name for p in top_modules)


def test_the_map_names_every_engine_module() -> None:
    """docs/architecture.md's table of the engine lists each module in its subpackage's row (the top
    modules in the row named "top"): a module added or renamed without the map fails here."""
    rows: dict[str, set[str]] = {}
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 3 and (cells[1].startswith("`engine/") or cells[1] == "top"):
            key = cells[1].strip("`").removeprefix("engine/").rstrip("/").removesuffix(".py")
            rows[key] = {part.strip(" `") for part in cells[2].replace("(", ",").replace(")", ",").split(",")}
    missing = []
    engine = ROOT / "engine"
    for path in engine.rglob("*.py"):
        if path.name == "__init__.py":
            continue
        rel = path.relative_to(engine)
        row = "top" if len(rel.parts) == 1 else rel.parts[0]
        if len(rel.parts) == 1 and rel.stem in rows:  # a top module with a row of its own (config)
            continue
        if rel.stem not in rows.get(row, set()):
            missing.append(str(rel))
    assert missing == []


def test_no_engine_module_imports_another_ones_private_names() -> None:
    """A name with a leading underscore is its module's own: a helper others need is public somewhere."""
    found = []
    for path in (ROOT / "engine").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if private:
                    found.append(f"{path.relative_to(ROOT)}: {node.module} {private}")
    assert found == []
