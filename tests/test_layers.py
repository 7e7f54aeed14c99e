"""The import floors of the tree: a module imports only from its own floor or below,
never upward, wherever the import stands (module top or inside a function)."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Lowest first. `meshes` and `pallas_kernels` are the ground floor: they import nothing
# of the library. Packages on one floor may import each other.
FLOORS = (
    ("meshes", "pallas_kernels"),
    ("hylora.core",),
    ("hylora.ops",),
    ("hylora.quant",),
    ("hylora.model",),
    ("hylora.data",),
    ("hylora.io",),
    ("hylora.train",),
    ("hylora.plan", "hylora.profile"),
    ("experiments",),
)
SOURCES = {
    "meshes": "meshes",
    "pallas_kernels": "pallas_kernels",
    "hylora": "src/hylora",
    "experiments": "experiments"
}


def floor_of(module: str) -> int | None:
  for level, packages in enumerate(FLOORS):
    if any(module == p or module.startswith(p + ".") for p in packages):
      return level
  return None


def modules():
  """(dotted name, path) of every non-test module of the tree."""
  for package, folder in SOURCES.items():
    for path in sorted((ROOT / folder).rglob("*.py")):
      if "tests" in path.relative_to(ROOT / folder).parts:
        continue
      parts = path.relative_to(ROOT / folder).with_suffix("").parts
      name = ".".join((package, *parts))
      yield name.removesuffix(".__init__"), path


def imported(name: str, path: pathlib.Path):
  """(imported module, line) for every import in the file, relative ones resolved."""
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield alias.name, node.lineno
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = package.split(".")[:len(package.split(".")) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
      else:
        module = node.module
      yield module, node.lineno
      for alias in node.names:  # `from hylora import plan` names a package too
        yield f"{module}.{alias.name}", node.lineno


def test_every_library_module_has_a_floor():
  unplaced = [name for name, _ in modules() if floor_of(name) is None and name != "hylora"]
  assert not unplaced, f"modules outside FLOORS: {unplaced}"


def test_no_import_runs_up_a_floor():
  upward = []
  for name, path in modules():
    mine = floor_of(name)
    if mine is None:
      continue
    for target, line in imported(name, path):
      theirs = floor_of(target)
      if theirs is not None and theirs > mine:
        upward.append(f"{path.relative_to(ROOT)}:{line} {name} -> {target}")
  assert not upward, "imports that run up a floor:\n" + "\n".join(upward)


@pytest.mark.parametrize("source, bad", [
    ("from hylora.train import run\n", "hylora.train.run"),
    ("def f():\n  from hylora.plan.dry_run import dry_run\n", "hylora.plan.dry_run"),
])
def test_the_check_sees_top_level_and_local_imports(tmp_path, source, bad):
  path = tmp_path / "mod.py"
  path.write_text(source)
  found = [m for m, _ in imported("hylora.model.mod", path)]
  assert bad in found and floor_of(bad) > floor_of("hylora.model.mod")
