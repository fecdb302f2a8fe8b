"""The package's layering, read from its imports with ``ast`` (no module is executed): no import
cycle between modules, no import from a lower floor into a higher one (nor between two rooms of
one floor), no import of another module's private ``_name``. The floors are written once, in
docs/architecture.md's ``layers`` block; a room is a folder of ``neuron_tp/`` (``errors`` is the
module ``neuron_tp/errors.py``, ``api`` the package's ``__init__.py``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = "neuron_tp"


def floors(doc: Path = REPO / "docs" / "architecture.md") -> dict[str, int]:
    """``{room: floor}`` from the ``layers`` block of docs/architecture.md."""
    block = re.search(r"```layers\n(.*?)```", doc.read_text(), re.S)
    assert block, f"{doc}: no ```layers block"
    out = {}
    for line in block.group(1).splitlines():
        floor, room = re.match(r"(\d+) (\w+):", line).groups()
        out[room] = int(floor)
    return out


def modules(root: Path = REPO) -> dict[str, Path]:
    """``{dotted module name: file}`` of every module of the package."""
    out = {}
    for f in sorted((root / PKG).rglob("*.py")):
        parts = list(f.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def imports(mods: dict[str, Path]) -> list[tuple[str, str, str | None, int]]:
    """``(importer, imported module, imported name or None, line)`` for every import of a
    package module, at any depth (function bodies, ``TYPE_CHECKING`` blocks)."""
    out = []
    for mod, path in mods.items():
        here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out += [(mod, a.name, None, node.lineno) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                src = ".".join(base + ([node.module] if node.module else []))
                for a in node.names:
                    if f"{src}.{a.name}" in mods:  # `from package import submodule`
                        out.append((mod, f"{src}.{a.name}", None, node.lineno))
                    else:
                        out.append((mod, src, a.name, node.lineno))
    return [i for i in out if i[1].split(".")[0] == PKG]


def owner(name: str, mods: dict[str, Path]) -> str:
    """The module a dotted name lives in (its longest module prefix)."""
    while name not in mods:
        name = name.rpartition(".")[0]
    return name


def room(mod: str) -> str:
    parts = mod.split(".")
    return "api" if len(parts) == 1 else parts[1]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def violations(root: Path = REPO) -> dict[str, list[str]]:
    """Everything the layering forbids, by kind (empty lists: a clean house)."""
    mods, order = modules(root), floors(root / "docs" / "architecture.md")
    edges: dict[str, set[str]] = {m: set() for m in mods}
    found: dict[str, list[str]] = {"unknown room": [], "back-arrow": [], "private": []}
    for rm in sorted({room(m) for m in mods} - set(order)):
        found["unknown room"].append(f"{rm}: give it a floor in docs/architecture.md")
    for src, target, name, line in imports(mods):
        tgt = owner(target, mods)
        where = f"{mods[src].relative_to(root)}:{line}"
        if tgt != src:
            edges[src].add(tgt)
        a, b = room(src), room(tgt)
        if a != b and a in order and b in order and order[b] >= order[a]:
            found["back-arrow"].append(
                f"{where}: {a} (floor {order[a]}) imports {tgt} ({b}, floor {order[b]})"
            )
        private = [p for p in (name, *target.split(".")[2:]) if p and p.startswith("_")]
        if tgt != src and any(not p.startswith("__") for p in private):
            found["private"].append(f"{where}: {src} imports {private[0]} from {tgt}")
    found["cycle"] = [" -> ".join(c) for c in cycles(edges)]
    return found


def test_every_room_has_a_floor():
    found = violations()["unknown room"]
    assert not found, "\n".join(found)


def test_no_import_cycle():
    found = violations()["cycle"]
    assert not found, "\n".join(found)


def test_no_import_up_or_across_the_floors():
    found = violations()["back-arrow"]
    assert not found, "\n".join(found)


def test_no_import_of_another_modules_private_name():
    found = violations()["private"]
    assert not found, "\n".join(found)


def private_attribute_owners(root: Path = REPO) -> dict[str, set[str]]:
    """``{"_ntp_...": modules whose source names it}`` over the package."""
    found: dict[str, set[str]] = {}
    for name, path in modules(root).items():
        for attr in re.findall(r"\b_ntp_[a-z_]+\b", path.read_text()):
            found.setdefault(attr, set()).add(name)
    return found


def test_each_private_model_attribute_is_read_by_the_module_that_owns_it():
    shared = {a: sorted(m) for a, m in private_attribute_owners().items() if len(m) > 1}
    assert not shared, f"_ntp_ attributes named by several modules (use an accessor): {shared}"


def test_private_attribute_check_sees_a_second_reader(tmp_path):
    pkg = tmp_path / "neuron_tp" / "parallel"
    pkg.mkdir(parents=True)
    (pkg / "state.py").write_text("_ATTR = '_ntp_state'\n")
    (pkg / "other.py").write_text("x = getattr(m, '_ntp_state', None)\n")
    assert private_attribute_owners(tmp_path)["_ntp_state"] == {
        "neuron_tp.parallel.state",
        "neuron_tp.parallel.other",
    }


GENERATOR = "neuron_tp.job.options"  # the one module that calls argparse's builders


def parser_builders(root: Path = REPO) -> list[str]:
    """Every call of ``ArgumentParser(``, ``add_argument(`` or ``add_argument_group(`` in the
    package outside :data:`GENERATOR`: each is an option declared outside its record."""
    found = []
    for mod, path in modules(root).items():
        if mod == GENERATOR:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if name in ("ArgumentParser", "add_argument", "add_argument_group"):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {name}(")
    return found


def test_every_parser_is_generated_from_an_options_record():
    """Options are declared once, as fields of a record (neuron_tp.job.options.opt); the
    argparse parsers are built from the records only."""
    found = parser_builders()
    assert not found, "\n".join(found)


def test_each_parser_has_exactly_its_records_options():
    """Every parser of the command line: its options are the record's fields, one to one
    (flag and destination), nothing added beside them."""
    from neuron_tp.cli import args, entry, plan, selftest
    from neuron_tp.job import config, options

    pairs = [
        (args.train_parser(), config.TrainConfig),
        (args.generate_parser(), config.GenerateConfig),
        (args.serve_parser(), config.ServeConfig),
        (plan.plan_parser(), plan.PlanOptions),
        (selftest.selftest_parser(), selftest.SelftestArgs),
        (entry.consolidate_parser(), entry.ConsolidateArgs),
    ]
    for parser, record in pairs:
        actions = {
            a.dest: (a.option_strings[0] if a.option_strings else a.dest)
            for a in parser._actions
            if a.dest != "help"
        }
        assert actions == options.option_flags(record), record.__name__
        assert len(actions) == len(parser._actions) - 1, record.__name__  # no shared dest


def test_the_plan_pins_are_the_layouts_train_options():
    """``neuron-tp plan``'s pins are the layout fields ``make_plan`` takes (layouts.PINS), each
    a ``neuron-tp train`` option of the same name and flag."""
    from dataclasses import fields

    from neuron_tp.cli.plan import LayoutPins
    from neuron_tp.job.config import TrainConfig
    from neuron_tp.job.options import option_flags
    from neuron_tp.plan.layouts import PINS, TRAIN_OPTIONS, Layout

    assert set(PINS) <= set(TRAIN_OPTIONS) <= {f.name for f in fields(Layout)}
    train = option_flags(TrainConfig)
    assert {n: train[n] for n in PINS} == option_flags(LayoutPins)


def listed_modules(doc: Path = REPO / "docs" / "architecture.md") -> dict[str, set[str]]:
    """``{room: modules}`` from the bracketed lists of docs/architecture.md's "rooms and their
    modules" block (a room's list may wrap over several lines)."""
    text = doc.read_text()
    block = re.search(r"## The rooms and their modules\n\n```\n(.*?)```", text, re.S)
    assert block, f"{doc}: no rooms-and-modules block"
    out: dict[str, set[str]] = {}
    for m in re.finditer(r"neuron_tp/(\w+)/\s.*?\[([^\]]*)\]", block.group(1), re.S):
        out[m.group(1)] = {n.strip() for n in m.group(2).replace("\n", " ").split(",")}
    return out


def test_the_docs_list_every_module_of_every_room():
    listed = listed_modules()
    actual: dict[str, set[str]] = {}
    for f in (REPO / PKG).glob("*/*.py"):
        if f.stem != "__init__":
            actual.setdefault(f.parent.name, set()).add(f.stem)
    assert set(listed) == set(actual), (sorted(listed), sorted(actual))
    wrong = {
        room: {
            "missing": sorted(actual[room] - listed[room]),
            "gone": sorted(listed[room] - actual[room]),
        }
        for room in actual
        if listed[room] != actual[room]
    }
    assert not wrong, f"docs/architecture.md's module lists differ from the package: {wrong}"
