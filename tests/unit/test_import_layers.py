"""The import graph of `rlhf/` (every `import`, at module level or inside a function, read with `ast`): no
package imports a package of a higher layer, and no module circle exists, within a package or across; and no
two modules of `rlhf/` and `kernels/` share a file name (a grep for a module's name lands in one place).
`PYTHONPATH=. python tests/unit/test_import_layers.py` prints the package graph."""

from __future__ import annotations

import ast
import os

from tests.distributed import ROOT

LAYERS = [
    {"assets", "kernels"},  # files and kernels: import nothing of rlhf
    {"config"},  # the typed config tree and its flag parser
    {"utils", "algorithms"},  # logging, checkpoints, timers; pure tensor functions
    {"data"},  # sources, formatting, samplers, records
    {"distributed", "models"},  # topology and collectives; model loading, log-probs, heads, LoRA
    {"engines"},  # DeepSpeed and rollout engines
    {"rewards"},
    {"agents", "inference"},
    {"planning"},  # the memory plan of a job's config (--dry_run), from model configs only
    {"core"},  # the job-agnostic core: loop, checkpoints, metrics, optimizer step, builders
    {"trainers"},  # each job's step
    {"repulse", "jobs"},  # the research algorithm beside PPO; each supervised and preference job's parts
    {"cli"},  # one thin module per job
]
"""Lowest first: a package may import its own layer's other packages only where that makes no circle."""


def module_imports() -> dict[str, set[str]]:
    """rlhf module -> the rlhf modules it imports (`from rlhf.p import m` imports the module rlhf.p.m when there
    is one)."""
    found: dict[str, list[tuple[str, list[str]]]] = {}
    for directory, _, files in os.walk(os.path.join(ROOT, "rlhf")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
            imports = found.setdefault(module, [])
            for node in ast.walk(ast.parse(open(path).read())):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rlhf"):
                    imports.append((node.module, [a.name for a in node.names]))
                elif isinstance(node, ast.Import):
                    imports.extend((a.name, []) for a in node.names if a.name.startswith("rlhf"))
    graph: dict[str, set[str]] = {}
    for module, imports in found.items():
        targets = graph.setdefault(module, set())
        for target, names in imports:
            submodules = {f"{target}.{n}" for n in names} & found.keys()
            targets.update(submodules or {target})
            if len(submodules) < len(names):  # some names are the package's own
                targets.add(target)
    return graph


def package_of(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def package_imports(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        out = packages.setdefault(package_of(module), set())
        out.update(package_of(t) for t in targets if package_of(t) not in ("", package_of(module)))
    return packages


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of `graph`, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_package_imports_a_higher_layer_and_no_circles():
    layer = {package: i for i, packages in enumerate(LAYERS) for package in packages}
    graph = module_imports()
    packages = package_imports(graph)
    assert set(packages) - {""} <= set(layer), f"a package with no layer: {set(packages) - set(layer) - {''}}"
    upward = [(p, t) for p, targets in packages.items() for t in targets if p and layer[t] > layer[p]]
    assert not upward, f"imports of a higher layer: {upward}"
    assert circle(packages) is None, f"a circle of packages: {circle(packages)}"
    modules = {m: {t for t in targets if t in graph and t != "rlhf"} for m, targets in graph.items()}
    assert circle(modules) is None, f"a circle of modules: {circle(modules)}"


def test_no_two_modules_share_a_file_name():
    seen: dict[str, list[str]] = {}
    for top in ("rlhf", "kernels"):
        for directory, _, files in os.walk(os.path.join(ROOT, top)):
            if os.path.relpath(directory, ROOT).startswith(os.path.join("rlhf", "assets")):
                continue  # the embedded demo's reward functions are data files loaded by path
            for name in files:
                if name.endswith(".py") and name != "__init__.py":
                    seen.setdefault(name, []).append(os.path.relpath(os.path.join(directory, name), ROOT))
    assert not {name: paths for name, paths in seen.items() if len(paths) > 1}


def test_the_checks_find_a_circle_and_an_upward_import():
    assert circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert circle({"a": {"b"}, "b": set()}) is None
    assert package_imports({"rlhf.config.x": {"rlhf.models.y", "rlhf.config.z"}}) == {"config": {"models"}}


if __name__ == "__main__":
    for package, targets in sorted(package_imports(module_imports()).items()):
        print(f"{package or 'rlhf'} -> {', '.join(sorted(targets)) or '(nothing)'}")


def test_setup_cfg_lists_every_package():
    """setup.cfg's `packages` are exactly the package directories (a package left out installs without it)."""
    import configparser

    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    listed = set(config["options"]["packages"].split())
    found = {"rlhf", "rlhf.kernels"} | {f"rlhf.{name}" for name in os.listdir(os.path.join(ROOT, "rlhf"))
                                        if os.path.isfile(os.path.join(ROOT, "rlhf", name, "__init__.py"))}
    assert listed == found
    folders = [os.path.join(ROOT, "rlhf", name) for name in os.listdir(os.path.join(ROOT, "rlhf"))]
    without_init = [f for f in folders if os.path.isdir(f) and any(n.endswith(".py") for n in os.listdir(f))
                    and not os.path.isfile(os.path.join(f, "__init__.py"))]
    assert without_init == []  # a folder of modules without __init__.py would be left out of a real install
