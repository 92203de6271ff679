"""The shape of the code, checked: the import layers of ``sidecar`` follow the data flow, the
SDKs stay at their edges, and the Spark side installs without the daemon's dependencies.

See docs/architecture.md for the picture these rules describe.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.services import REPO_ROOT

REPO = REPO_ROOT
SIDECAR = REPO / "sidecar"

#: The base, at the bottom: every package may import these modules (``config`` is a package
#: of two modules; ``sidecar`` itself holds only ``__version__``).
BASE = {"errors", "backoff", "config"}
#: The packages of ``sidecar`` in the order data flows, each with the packages it may import
#: besides the base and itself. Written once, here: docs/architecture.md's table is checked
#: against it.
PACKAGES: dict[str, set[str]] = {
    "model": set(),
    "wire": {"model"},
    "telemetry": {"wire"},
    "buffer": {"model"},
    "store": {"model"},
    "ingest": {"wire", "model", "buffer", "telemetry"},
    "flush": {"model", "buffer", "telemetry"},  # the store through protocols only
    "sinks": {"model"},  # what the position sinks below share: their commit loop
    "kafka": {"model", "telemetry", "sinks"},
    "eventhubs": {"model", "telemetry", "sinks"},  # the store through a protocol only
    "snapshot": {"model"},  # the store through a protocol only
    "ops": {"wire", "model", "buffer", "store", "kafka", "eventhubs", "snapshot"},
    "daemon": {"ingest", "flush", "kafka", "eventhubs", "ops", "buffer", "store", "telemetry"}
    | {"wire", "model", "snapshot", "sinks"},
    "cli": {"daemon", "ops", "kafka", "eventhubs", "flush", "ingest", "store", "buffer"}
    | {"telemetry", "wire", "model", "snapshot", "sinks"},
}
#: Packages that are pure as a whole, and pure modules of the others: no event loop, no
#: socket, no SDK (the wire format, the records, the rules).
PURE_PACKAGES = {"model", "wire", "config"}
PURE_MODULES = {
    "errors",
    "backoff",
    "buffer.keys",
    "buffer.refusals",
    "buffer.lua",
    "buffer.rows",
    "store.probe",
    "ops.diagnosis",
    "sinks.report",
    "eventhubs.plan",
    "flush.blob",
    "flush.core",
    "flush.events",
    "flush.lease",
    "ingest.replies",
    "snapshot.cut",
    "snapshot.index",
    "snapshot.lineage",
    "snapshot.relocate",
    "snapshot.retention",
    "telemetry.logs",  # stdlib only: cli.main sets logging up without the daemon's extra
}
#: Third-party SDKs and the modules that may import them: each edge owns its SDK.
SDK_OWNERS = {
    "redis": {"buffer.redis_buffer", "buffer.topology"},
    # store.account and store.eventhubs (split from store.blobs): the SDK's types, TYPE_CHECKING
    "azure": {"store.account", "store.blobs", "store.eventhubs", "store.sdk", "store.remote"},
    "aiokafka": {"kafka.client", "kafka.committer"},
    "h11": {"daemon.http"},
    "prometheus_client": {"telemetry.metrics", "kafka.lag", "daemon.http", "daemon.app"},
    "uvloop": {"cli.commands"},  # chosen once, at the start (SIDECAR_EVENT_LOOP)
}
IO_LIBRARIES = {"anyio", "asyncio", "socket", "redis", "azure", "aiokafka", "aiohttp"}


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in the file (TYPE_CHECKING blocks included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            # from sidecar.model import checkpoint as ckpt: a module of the package
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def modules() -> dict[str, set[str]]:
    """Every module of ``sidecar`` by dotted name below it (``flush.lease``, ``errors``), with
    the sidecar modules and packages it imports (same form) and the other roots it imports."""
    out: dict[str, set[str]] = {}
    for path in sorted(SIDECAR.rglob("*.py")):
        rel = path.relative_to(SIDECAR).with_suffix("")
        name = ".".join(rel.parts)
        out[name] = imports_of(path)
    return out


def sidecar_target(module: str) -> str | None:
    """``sidecar.flush.lease`` -> ``flush``; ``sidecar.errors`` -> ``errors``; the package (or
    base module) a sidecar import lands in; None for other roots and ``sidecar`` itself."""
    parts = module.split(".")
    return parts[1] if parts[0] == "sidecar" and len(parts) > 1 else None


def package_of(name: str) -> str:
    return name.split(".")[0]


def test_the_tree_is_packages_by_concern() -> None:
    top = sorted(p.stem for p in SIDECAR.glob("*.py"))
    assert top == ["__init__", "__main__", "backoff", "errors"]
    packages = sorted(p.name for p in SIDECAR.iterdir() if (p / "__init__.py").is_file())
    assert set(packages) == set(PACKAGES) | {"config"}
    for package in packages:
        doc = ast.get_docstring(ast.parse((SIDECAR / package / "__init__.py").read_text()))
        assert doc and "May import" in doc, (
            f"sidecar/{package}/__init__.py must say what it may import"
        )


def test_the_package_rules_form_a_dag() -> None:
    order: list[str] = []
    visiting: set[str] = set()

    def visit(package: str) -> None:
        assert package not in visiting, f"the package rules have a cycle through {package}"
        if package in order:
            return
        visiting.add(package)
        for lower in PACKAGES[package]:
            visit(lower)
        visiting.discard(package)
        order.append(package)

    for package in PACKAGES:
        visit(package)
    assert len(order) == len(PACKAGES)


def test_each_module_imports_only_what_its_package_may() -> None:
    wrong = []
    for name, imported in modules().items():
        own = package_of(name)
        for module in imported:
            target = sidecar_target(module)
            if target in (None, own, "__version__"):  # sidecar.__version__: the root's one name
                continue
            if own == "__main__":
                allowed = {"cli"}
            elif own in BASE:
                allowed = {"errors"} if own == "config" else set()
            else:
                allowed = BASE | PACKAGES.get(own, set())
            if target not in allowed:
                wrong.append(f"{name} imports {module}")
    assert wrong == []


def test_no_cycle_between_modules() -> None:
    graph = {
        name: {".".join(m.split(".")[1:]) for m in imported if m.split(".")[0] == "sidecar"}
        for name, imported in modules().items()
    }
    graph = {
        name: {m for m in targets if m in graph and m != name} for name, targets in graph.items()
    }
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        assert name not in path, f"import cycle: {' -> '.join([*path, name])}"
        if name in done:
            return
        for target in graph[name]:
            if not target.endswith("__init__"):
                visit(target, [*path, name])
        done.add(name)

    for name in graph:
        visit(name, [])


def test_the_server_knows_nothing_beyond_the_protocol() -> None:
    allowed = {"config", "errors", "ingest.connection", "ingest.replies", "telemetry.metrics"}
    allowed |= {"wire.protocol", "wire.endpoint"}
    inner = [
        m.removeprefix("sidecar.") for m in modules()["ingest.server"] if m.startswith("sidecar.")
    ]
    assert [m for m in inner if not any(m == a or m.startswith(f"{a}.") for a in allowed)] == []


def test_pure_modules_do_no_io_and_each_sdk_stays_at_its_edge() -> None:
    wrong = []
    for name, imported in modules().items():
        roots = {m.split(".")[0] for m in imported}
        pure = package_of(name) in PURE_PACKAGES or name in PURE_MODULES
        if pure and roots & IO_LIBRARIES:
            wrong.append(f"pure {name} imports {sorted(roots & IO_LIBRARIES)}")
        for sdk, owners in SDK_OWNERS.items():
            if sdk in roots and name not in owners:
                wrong.append(f"{name} imports {sdk} (owned by {sorted(owners)})")
    assert wrong == []


#: What of the Spark side each package of ``sidecar`` may import: ``model`` its pure resume
#: rules (their one source), ``cli`` anything (``listener-jar``); nothing else, so that
#: ``spark_bridge`` stays a leaf the daemon barely touches.
BRIDGE_IMPORTS = {"model": {"spark_bridge.resume"}}


def test_the_daemon_imports_little_of_the_spark_side() -> None:
    wrong = []
    for name, imported in modules().items():
        own = package_of(name)
        for module in imported:
            if module.split(".")[0] != "spark_bridge" or own == "cli":
                continue
            allowed = BRIDGE_IMPORTS.get(own, set())
            if not any(module == a or module.startswith(f"{a}.") for a in allowed):
                wrong.append(f"{name} imports {module}")
    assert wrong == []


def test_no_product_module_is_a_test_service() -> None:
    assert not list(SIDECAR.rglob("devservices.py"))
    assert not list(SIDECAR.rglob("services.py"))


def test_the_spark_side_imports_nothing_of_the_daemon() -> None:
    """``spark_bridge`` runs on drivers with only the standard library (Python 3.8+): it
    imports no ``sidecar`` module, anywhere in any file (inside functions included). What
    needs the daemon's package reads the blobs through its command line, in a child process."""
    bridge = REPO / "spark_bridge"
    wrong = [
        f"{path.relative_to(REPO)} imports {module}"
        for path in sorted(bridge.rglob("*.py"))
        for module in imports_of(path)
        if module.split(".")[0] == "sidecar"
    ]
    assert wrong == []


def test_no_cycle_between_packages() -> None:
    """The packages of ``sidecar`` as they import each other (not as the rules allow): a
    directed acyclic graph, read from the code."""
    graph: dict[str, set[str]] = {}
    for name, imported in modules().items():
        own = package_of(name)
        targets = {sidecar_target(m) for m in imported} - {None, own, "__version__"}
        graph.setdefault(own, set()).update(t for t in targets if t is not None)
    done: set[str] = set()

    def visit(package: str, path: list[str]) -> None:
        assert package not in path, f"package cycle: {' -> '.join([*path, package])}"
        if package in done:
            return
        for target in sorted(graph.get(package, ())):
            visit(target, [*path, package])
        done.add(package)

    for package in sorted(graph):
        visit(package, [])


#: The longest a function of the daemon may be: one a reader holds in their head.
MAX_FUNCTION_LINES = 100


def test_no_function_of_the_daemon_is_over_a_screenful_or_two() -> None:
    long = []
    for path in sorted((REPO_ROOT / "sidecar").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    rel = path.relative_to(REPO_ROOT)
                    long.append(f"{rel}:{node.lineno} {node.name}: {lines} lines")
    assert long == [], f"split by job (at most {MAX_FUNCTION_LINES} lines each): {long}"


def _doc_table() -> dict[str, str]:
    """docs/architecture.md's package table: each package's "may import" cell, in order."""
    rows: dict[str, str] = {}
    for line in (REPO / "docs" / "architecture.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and cells[0].endswith("`"):
            rows[cells[0].strip("`")] = cells[2]
    return rows


def _named(cell: str) -> set[str]:
    return {part.split("`")[0] for part in cell.split("`")[1::2]}


def test_the_docs_package_table_says_what_these_rules_say() -> None:
    """The rules are written once, here; the architecture page's table is checked against
    them: its order, and each package's "may import" ("everything above": every package
    before it)."""
    table = _doc_table()
    assert list(table) == ["config", *PACKAGES], "the table's packages, in the data's order"
    for i, (package, allowed) in enumerate(PACKAGES.items()):
        cell = table[package]
        above = set(list(PACKAGES)[:i])
        if cell.startswith("everything"):
            named = above
        else:
            named = _named(cell) - {"spark_bridge.resume", "spark_bridge"}
        assert named == allowed, f"{package}: the docs say {sorted(named)}, the rules {allowed}"


def test_the_docs_list_the_pure_modules_these_rules_check() -> None:
    text = " ".join((REPO / "docs" / "architecture.md").read_text().split())
    start = text.index("as are these modules of the others:")
    listed = _named(text[start : text.index("Pure: no event loop", start)])
    assert listed == PURE_MODULES - {"errors", "backoff"}


def test_the_flush_owner_is_held_through_a_door_of_at_most_fifteen_verbs() -> None:
    """Other packages import of ``sidecar.flush`` only the door (``owner``) and the lease's
    values (``lease``), and the classes they import expose 15 public methods between them: no
    one else reaches a query's record, the lease table or the loop (docs/flush-owner.md)."""
    imported: set[tuple[str, str]] = set()
    for path in SIDECAR.rglob("*.py"):
        if path.is_relative_to(SIDECAR / "flush"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sidecar.flush"):
                imported.update((node.module or "", alias.name) for alias in node.names)
    assert {module for module, _ in imported} <= {"sidecar.flush.owner", "sidecar.flush.lease"}
    verbs: dict[str, list[str]] = {}
    for module, name in sorted(imported):
        tree = ast.parse((REPO / f"{module.replace('.', '/')}.py").read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                verbs[name] = [
                    f.name
                    for f in node.body
                    if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                    and not f.name.startswith("_")
                ]
    assert "FlushOwner" in verbs, imported
    assert sum(len(v) for v in verbs.values()) <= 15, verbs


#: The maps keyed by query id that ``sidecar/flush`` and ``sidecar/daemon`` may keep on their
#: objects: the two records (the flush owner's and the daemon's) and, each with its reason in
#: docs/flush-owner.md, the store listing's cache and the quarantine.
QUERY_MAPS = {
    ("flush/core.py", "_queries"),  # the flush owner's record
    ("daemon/queries.py", "_live"),  # the daemon's record
    ("flush/blob_state.py", "_with_blob"),  # a cache of the store's listing
    ("flush/quarantine.py", "_records"),  # records unreadable, perhaps of no known name
}


def test_per_query_facts_live_on_the_two_records_not_in_maps_of_their_own() -> None:
    """An attribute annotated as a map or set keyed by ``str`` (a query id, in practice) in
    ``flush/`` or ``daemon/`` is one of :data:`QUERY_MAPS`: a new per-query fact goes on a
    record, so retiring a query stays one removal for each (docs/flush-owner.md)."""
    found: set[tuple[str, str]] = set()
    for package in ("flush", "daemon"):
        for path in (SIDECAR / package).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (
                    isinstance(node, ast.AnnAssign)
                    and isinstance(node.target, ast.Attribute)
                    and isinstance(node.target.value, ast.Name)
                    and node.target.value.id == "self"
                ):
                    continue
                kind = ast.unparse(node.annotation)
                if kind.split("[")[0] in ("dict", "set", "OrderedDict") and "[str" in kind:
                    found.add((f"{package}/{path.name}", node.target.attr))
    assert found == QUERY_MAPS
