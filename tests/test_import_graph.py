"""The repository's import graph (scripts/import_graph.py): no cycle, and deployments/ stays shallow."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
import_graph = importlib.util.module_from_spec(spec)
spec.loader.exec_module(import_graph)


def test_no_import_cycle_in_the_repository():
    assert import_graph.cycles(import_graph.graph()) == []


def test_cycles_and_layers_on_a_hand_built_graph():
    edges = {"p": set(), "p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a", "q"}, "p.d": {"p.e"}, "p.e": set(), "q": set()}
    assert import_graph.cycles(edges) == [["p.a", "p.b", "p.c"]]
    del edges["p.c"]
    edges["p.b"] = set()
    assert import_graph.layers(edges, "p") == {"p": 1, "p.a": 2, "p.b": 1, "p.d": 2, "p.e": 1}


def test_relative_and_from_imports_resolve_to_modules(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from . import leaf\n")
    (package / "sub" / "leaf.py").write_text("from ..top import NAME\nimport pkg.other\n")
    (package / "top.py").write_text("NAME = 1\n")
    (package / "other.py").write_text("from pkg.sub import leaf\n")
    edges = import_graph.graph(tmp_path, ("pkg",))
    assert edges["pkg.sub"] == {"pkg.sub.leaf"}
    assert edges["pkg.sub.leaf"] == {"pkg.top", "pkg.other"}
    assert import_graph.cycles(edges) == [["pkg.other", "pkg.sub.leaf"]]


def test_deployments_is_at_most_six_layers_deep():
    layers = import_graph.layers(import_graph.graph(), "deployments")
    assert max(layers.values()) <= 6, sorted(layers.items(), key=lambda item: -item[1])[:5]


# What each subpackage of deployments/ may import of deployments/ (docs/design.md, "Layout"); the top-level modules
# config, errors and auth are shared by all (body_limit by the API layer and the proxy), and app (the composition
# root) imports any.
ALLOWED = {
    "deployments.runtime": {"deployments.config", "deployments.errors", "deployments.runtime"},
    "deployments.workers": {"deployments.config", "deployments.errors", "deployments.runtime", "deployments.workers"},
    "deployments.serving": {"deployments.config", "deployments.errors", "deployments.auth", "deployments.runtime",
                            "deployments.serving", "deployments.workers.api"},
    "deployments.api": {"deployments.config", "deployments.errors", "deployments.auth", "deployments.body_limit",
                        "deployments.serving", "deployments.api"},
    "deployments.tools": {"deployments.config", "deployments.tools"},
}


def test_each_subpackage_imports_only_what_its_layer_may():
    edges = import_graph.graph()
    wrong = []
    for module, targets in edges.items():
        package = next((package for package in ALLOWED if module == package or module.startswith(package + ".")),
                       None)
        if package is None:
            continue
        for target in targets:
            if target.startswith("deployments") and not any(
                    target == allowed or target.startswith(allowed + ".") for allowed in ALLOWED[package]):
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_the_api_layer_does_not_import_the_actor_transport():
    edges = import_graph.graph()
    api = {module: targets for module, targets in edges.items() if module.startswith("deployments.api")}
    transport = {"deployments.workers.clients", "deployments.workers.actors"}
    assert api and not [module for module, targets in api.items() if targets & transport]
