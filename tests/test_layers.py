"""The layers rule of ARCHITECTURE.md, enforced on every import in the package (lazy ones inside functions and
`TYPE_CHECKING` blocks included): imports only go down.

    kernels <- engine <- chat <- agent <- mcp,   chat <- api,   tools <- agent / mcp (tools knows no model),
    options (shared command options) <- the `commands` modules, serve and cli;  cli <- __main__ only;
    errors (the UserError base) below them all.

`api` and `mcp` do not import each other; `serve` is the one place that wires them together. `bench` and `train`
are tooling on top of the engine (`bench` may drive the HTTP API in-process).
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

PACKAGE = "dflash_agent"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# layer -> the layers it may import directly; what those may import it may import too (down is down).
DEPENDS: dict[str, set[str]] = {
    "errors": set(),  # UserError, the base every layer's user-facing errors share
    "version": set(),  # the installed package's version
    "kernels": {"errors", "version"},
    "engine": {"kernels"},
    "templates": set(),  # package data: the bundled chat templates
    "chat": {"engine", "templates"},
    "tools": {"errors", "version"},
    "agent": {"chat", "tools"},
    "mcp": {"agent", "tools"},
    "api": {"chat"},
    "options": {"engine"},
    "bench": {"api", "options"},
    "train": {"options"},
    "serve": {"api", "mcp", "options"},
    "connect": {"options"},
    "cli": {"options", "chat"},
    "__main__": {"cli"},
    "__init__": set(),
}
# A layer's `commands` module is its CLI glue: it may also use the shared command options.
COMMANDS_MAY_IMPORT = {"options"}


def allowed(layer: str) -> set[str]:
    seen: set[str] = set()
    todo = [layer]
    while todo:
        for below in DEPENDS.get(todo.pop(), set()):  # an unknown layer may import nothing
            if below not in seen:
                seen.add(below)
                todo.append(below)
    return seen


def layer_of(module: str) -> str:
    """`dflash_agent.engine.model.gemma` -> `engine`; `dflash_agent.cli` -> `cli`; `dflash_agent` -> `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, module: str, ours: str = PACKAGE) -> list[tuple[str, int]]:
    """Every module of the package `ours` that `path` imports, absolute, with its line."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                if node.module:
                    found.append((".".join([*base, node.module]), node.lineno))
                else:  # `from . import x`: x is a module (or a name) of that package
                    found += [(".".join([*base, alias.name]), node.lineno) for alias in node.names]
            elif node.module:
                found.append((node.module, node.lineno))
    return [(name, line) for name, line in found if name == ours or name.startswith(ours + ".")]


def import_graph(root: Path = ROOT) -> dict[str, list[tuple[str, int]]]:
    return {module_name(path, root): imports_of(path, module_name(path, root), root.name)
            for path in sorted(root.rglob("*.py"))}


def violations(graph: Mapping[str, Iterable[tuple[str, int]]]) -> list[str]:
    """One line per import that goes up or sideways, e.g. `dflash_agent.engine.x:3 imports dflash_agent.chat`."""
    bad = []
    for module, imported in graph.items():
        layer = layer_of(module)
        ok = allowed(layer) | {layer}
        if module.rpartition(".")[2] == "commands":
            ok |= COMMANDS_MAY_IMPORT
        for target, line in imported:
            if layer_of(target) not in ok:
                bad.append(f"{module}:{line} imports {target} ({layer} -> {layer_of(target)})")
    return bad


# The engine's rooms (docs/architecture.md), bottom first: each imports only the rooms below it. The contract
# modules at engine/'s top (types, errors, ...) sit below every room; engine/'s own __init__ (the lazy public
# names) and the runtime on top (memory_plan, scheduler, engine) may import any room.
ENGINE = f"{PACKAGE}.engine"
ENGINE_CONTRACT = {"types", "errors", "engine_config", "progress", "paths", "limits", "host_memory", "bandit"}
ENGINE_ROOMS = ["formats", "cache", "model", "backends", "load", "runner", "decode"]
ENGINE_TOP = {"memory_plan", "scheduler", "engine", "__init__"}


def room_of(module: str) -> str | None:
    """`dflash_agent.engine.model.gemma` -> `model`; `dflash_agent.engine.types` -> `contract`; None outside."""
    if module == ENGINE:
        return "__init__"
    if not module.startswith(ENGINE + "."):
        return None
    first = module.split(".")[2]
    return "contract" if first in ENGINE_CONTRACT else first


def room_allows(room: str) -> set[str]:
    if room in ENGINE_TOP:
        return {"contract", *ENGINE_ROOMS, *ENGINE_TOP}
    if room == "contract":
        return {"contract"}
    return {"contract", *ENGINE_ROOMS[: ENGINE_ROOMS.index(room) + 1]}


def crossings(graph: Mapping[str, Iterable[tuple[str, int]]], room_of_module: Callable[[str], str | None],
              allows: Callable[[str, str], bool]) -> list[str]:
    """One line per import from a module in a room (room_of_module not None) that `allows(room, target)` refuses."""
    bad = []
    for module, imported in graph.items():
        room = room_of_module(module)
        if room is None:
            continue
        for target, line in imported:
            if not allows(room, target):
                into = room_of_module(target) or layer_of(target)
                bad.append(f"{module}:{line} imports {target} ({room} -> {into})")
    return bad


def room_violations(graph: Mapping[str, Iterable[tuple[str, int]]]) -> list[str]:
    """One line per import inside engine/ that goes up a room or sideways."""
    return crossings(graph, room_of, lambda room, target: room_of(target) in room_allows(room) | {None})


def test_every_engine_import_goes_down_the_rooms():
    assert room_violations(import_graph()) == []


def test_every_engine_module_is_in_a_room():
    rooms = {room_of(module) for module in import_graph()} - {None}
    assert rooms <= {"contract", *ENGINE_ROOMS, *ENGINE_TOP}, sorted(rooms)


def test_the_room_scan_sees_the_real_imports():
    edges = {(room_of(m), room_of(t)) for m, imported in import_graph().items() for t, _ in imported}
    assert {("cache", "formats"), ("model", "cache"), ("backends", "model"), ("load", "model"),
            ("runner", "backends"), ("decode", "runner"), ("decode", "load"), ("scheduler", "decode"),
            ("formats", "contract")} <= edges


def test_planted_room_violations_are_flagged():
    graph = {
        f"{ENGINE}.formats.config": [(f"{ENGINE}.errors", 1), (f"{ENGINE}.cache.kv_cache", 2)],
        f"{ENGINE}.model.gemma": [(f"{ENGINE}.backends.cpu", 3), (f"{ENGINE}.formats.quant", 4)],
        f"{ENGINE}.load.weights": [(f"{ENGINE}.backends.cpu", 5), (f"{ENGINE}.decode.sampling", 6)],
        f"{ENGINE}.limits": [(f"{ENGINE}.model.gemma", 7)],
        f"{ENGINE}.scheduler": [(f"{ENGINE}.decode.speculative", 8), (f"{ENGINE}.engine", 9)],
        f"{PACKAGE}.chat.parser": [(f"{ENGINE}.decode.grammar", 10)],
    }
    assert room_violations(graph) == [
        f"{ENGINE}.formats.config:2 imports {ENGINE}.cache.kv_cache (formats -> cache)",
        f"{ENGINE}.model.gemma:3 imports {ENGINE}.backends.cpu (model -> backends)",
        f"{ENGINE}.load.weights:6 imports {ENGINE}.decode.sampling (load -> decode)",
        f"{ENGINE}.limits:7 imports {ENGINE}.model.gemma (contract -> model)",
    ]


# kernels/'s rooms: the C library (cpu) and the Triton kernels (triton) know nothing of each other; the modules at
# kernels/'s top (attention, dispatch, capture) choose where work runs and may reach the Triton kernels. None of
# them imports the engine, nor anything else of ours but errors.
KERNELS = f"{PACKAGE}.kernels"
KERNEL_ROOMS = {"cpu": {"cpu"}, "triton": {"triton", "top"}, "top": {"top", "triton"}}


def kernel_room_of(module: str) -> str | None:
    """`dflash_agent.kernels.cpu.cpu_dot` -> `cpu`; `dflash_agent.kernels.dispatch` -> `top`; None outside."""
    if module == KERNELS:
        return "top"
    if not module.startswith(KERNELS + "."):
        return None
    first = module.split(".")[2]
    return first if first in KERNEL_ROOMS else "top"


def kernel_violations(graph: Mapping[str, Iterable[tuple[str, int]]]) -> list[str]:
    """One line per import of a kernels module that leaves its room's reach (the engine included)."""
    return crossings(graph, kernel_room_of, lambda room, target: layer_of(target) == "errors"
                     or kernel_room_of(target) in KERNEL_ROOMS[room])


def test_kernels_import_nothing_of_the_engine_and_their_rooms_keep_apart():
    graph = import_graph()
    assert kernel_violations(graph) == []
    edges = {(kernel_room_of(m), kernel_room_of(t)) for m, imported in graph.items() for t, _ in imported}
    assert {("top", "triton"), ("triton", "top"), ("cpu", "cpu"), ("triton", "triton")} <= edges


def test_planted_kernel_violations_are_flagged():
    graph = {
        f"{KERNELS}.cpu.cpu_dot": [(f"{KERNELS}.cpu.build", 1), (f"{ENGINE}.types", 2), (f"{KERNELS}.dispatch", 3)],
        f"{KERNELS}.triton.quant_matmul": [(f"{KERNELS}.dispatch", 4), (f"{KERNELS}.cpu.cpu_dot", 5)],
        f"{KERNELS}.attention": [(f"{KERNELS}.triton.attention_triton", 6), (f"{ENGINE}.model.gemma", 7)],
        f"{KERNELS}.triton.rms_norm": [(f"{PACKAGE}.errors", 8)],
    }
    assert kernel_violations(graph) == [
        f"{KERNELS}.cpu.cpu_dot:2 imports {ENGINE}.types (cpu -> engine)",
        f"{KERNELS}.cpu.cpu_dot:3 imports {KERNELS}.dispatch (cpu -> top)",
        f"{KERNELS}.triton.quant_matmul:5 imports {KERNELS}.cpu.cpu_dot (triton -> cpu)",
        f"{KERNELS}.attention:7 imports {ENGINE}.model.gemma (top -> engine)",
    ]


def test_every_package_import_goes_down():
    graph = import_graph()
    assert violations(graph) == []


def test_every_layer_is_in_the_rule():
    layers = {layer_of(module) for module in import_graph()}
    assert layers <= set(DEPENDS), f"layers missing from DEPENDS: {sorted(layers - set(DEPENDS))}"


def test_the_scan_sees_the_real_imports():
    # A scan that found nothing would pass the rule vacuously: it must see the edges the package is built on.
    edges = {(layer_of(module), layer_of(target)) for module, imported in import_graph().items()
             for target, _ in imported}
    assert {("engine", "kernels"), ("chat", "engine"), ("agent", "chat"), ("mcp", "agent"), ("api", "chat"),
            ("serve", "mcp"), ("__main__", "cli")} <= edges


def test_relative_imports_resolve_to_absolute_modules(tmp_path):
    package = tmp_path / PACKAGE / "engine"
    package.mkdir(parents=True)
    (tmp_path / PACKAGE / "__init__.py").write_text("")
    (package / "__init__.py").write_text("from .types import Usage\nfrom .. import cli\n")
    (package / "model.py").write_text(
        "import os\nfrom ..kernels.dispatch import mm\n\ndef f():\n    from ...dflash_agent import x\n"
        "    from ..chat import parser\n")
    graph = import_graph(tmp_path / PACKAGE)
    assert graph[f"{PACKAGE}.engine"] == [(f"{PACKAGE}.engine.types", 1), (f"{PACKAGE}.cli", 2)]
    assert (f"{PACKAGE}.kernels.dispatch", 2) in graph[f"{PACKAGE}.engine.model"]
    assert (f"{PACKAGE}.chat", 6) in graph[f"{PACKAGE}.engine.model"]


def test_planted_violations_are_flagged():
    graph = {
        "dflash_agent.engine.model.gemma": [("dflash_agent.kernels.dispatch", 1), ("dflash_agent.chat.parser", 7)],
        "dflash_agent.kernels.attention": [("dflash_agent.engine", 3)],
        "dflash_agent.tools.bash": [("dflash_agent.engine.engine", 4)],
        "dflash_agent.api.app": [("dflash_agent.mcp.http", 5), ("dflash_agent.engine", 6)],
        "dflash_agent.mcp.server": [("dflash_agent.api.service", 8), ("dflash_agent.agent.loop", 9)],
        "dflash_agent.mcp.commands": [("dflash_agent.options", 2), ("dflash_agent.cli", 3)],
        "dflash_agent.mcp.model": [("dflash_agent.options", 4)],
        "dflash_agent.serve": [("dflash_agent.api.app", 1), ("dflash_agent.mcp.http", 2)],
        "dflash_agent.__main__": [("dflash_agent.cli", 1)],
    }
    assert violations(graph) == [
        "dflash_agent.engine.model.gemma:7 imports dflash_agent.chat.parser (engine -> chat)",
        "dflash_agent.kernels.attention:3 imports dflash_agent.engine (kernels -> engine)",
        "dflash_agent.tools.bash:4 imports dflash_agent.engine.engine (tools -> engine)",
        "dflash_agent.api.app:5 imports dflash_agent.mcp.http (api -> mcp)",
        "dflash_agent.mcp.server:8 imports dflash_agent.api.service (mcp -> api)",
        "dflash_agent.mcp.commands:3 imports dflash_agent.cli (mcp -> cli)",
        "dflash_agent.mcp.model:4 imports dflash_agent.options (mcp -> options)",
    ]


# The tests' own rule: what several test modules share lives in tests/helpers/ (or a folder's helper modules), never
# in a test module, so that no test module runs another's collection and fixtures, and no two import each other.
TESTS = Path(__file__).resolve().parent


def imports_of_test_modules(root: Path = TESTS) -> list[str]:
    """One line per import of a test module (test_*.py) anywhere under tests/, `from tests.x import test_y` too."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        imported = imports_of(path, module, root.name)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported += [(f"{node.module}.{alias.name}", node.lineno) for alias in node.names]
        bad += sorted({f"{module}:{line} imports {target}" for target, line in imported
                       if any(part.startswith("test_") for part in target.split(".")[1:])})
    return bad


def test_no_test_module_imports_another():
    assert imports_of_test_modules() == []


def test_planted_test_module_imports_are_flagged(tmp_path):
    root = tmp_path / "tests"
    (root / "engine").mkdir(parents=True)
    (root / "helpers").mkdir()
    for package in (root, root / "engine", root / "helpers"):
        (package / "__init__.py").write_text("")
    (root / "engine" / "test_a.py").write_text("from .test_b import VOCAB\nfrom tests.helpers.configs import x\n")
    (root / "engine" / "test_b.py").write_text("def f():\n    from tests.engine import test_a\n")
    (root / "helpers" / "configs.py").write_text("import tests.engine.test_b\n")
    (root / "conftest.py").write_text("from tests.engine.test_a import fixture  # noqa\n")
    assert imports_of_test_modules(root) == [
        "tests.conftest:1 imports tests.engine.test_a",
        "tests.conftest:1 imports tests.engine.test_a.fixture",
        "tests.engine.test_a:1 imports tests.engine.test_b",
        "tests.engine.test_b:2 imports tests.engine.test_a",
        "tests.helpers.configs:1 imports tests.engine.test_b",
    ]
