"""No import cycles inside the package: every arrow between jaxrlvr modules runs one way; and outside a family (a
subpackage) its modules are reached through its face, the __init__.py.

Imports inside functions count too: a lazy import that closes a cycle only hides it until the day the import order
changes. The graph is read from the source (ast), so nothing is imported here.
"""
import ast
import os

_PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jaxrlvr")


def _modules() -> dict[str, str]:
  """Dotted module name -> file, for every .py file of the package (a package is its __init__.py)."""
  out = {}
  root = os.path.dirname(_PACKAGE)
  for folder, _, files in os.walk(_PACKAGE):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        dotted = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
        out[dotted.removesuffix(".__init__")] = path
  return out


def import_graph() -> dict[str, set[str]]:
  return import_graph_of(_modules())


def import_graph_of(modules: dict[str, str]) -> dict[str, set[str]]:
  graph = {m: set() for m in modules}
  for module, path in modules.items():
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
      targets = []
      if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        # `from a.b import c` imports module a.b.c when it exists, else a name of a.b.
        targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                   for a in node.names]
      for target in targets:
        while target not in modules and "." in target:
          target = target.rsplit(".", 1)[0]
        # A package's __init__ importing its own modules is how packages work, not a cycle.
        if target in modules and target != module and not target.startswith(module + "."):
          graph[module].add(target)
  return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  state: dict[str, int] = {}  # 1: on the current path, 2: done
  path: list[str] = []

  def visit(node):
    state[node] = 1
    path.append(node)
    for nxt in sorted(graph[node]):
      if state.get(nxt) == 1:
        return path[path.index(nxt):] + [nxt]
      if nxt not in state:
        found = visit(nxt)
        if found:
          return found
    path.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state:
      found = visit(node)
      if found:
        return found
  return None


def test_find_cycle_finds_one():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_package_has_no_import_cycle():
  cycle = find_cycle(import_graph())
  assert cycle is None, " -> ".join(cycle)


def private_imports(modules: dict[str, str] | None = None, graph: dict[str, set[str]] | None = None) -> list[str]:
  """`importer -> module` for every import of a family's private module from outside the family. A family is a
  subpackage of jaxrlvr (rollout, plan, compare, outputs, models, data, replay, rewards); its face is its
  __init__.py, and its other modules are private to it: code elsewhere in the package goes through the face."""
  modules = modules or _modules()
  families = {m for m in modules if modules[m].endswith("__init__.py") and m != "jaxrlvr"}
  graph = graph if graph is not None else import_graph_of(modules)
  out = []
  for importer, targets in graph.items():
    for target in targets:
      family = next((f for f in families if target.startswith(f + ".")), None)
      if family and importer != family and not importer.startswith(family + "."):
        out.append(f"{importer} -> {target}")
  return sorted(out)


def test_private_imports_are_found():
  modules = {"jaxrlvr": "jaxrlvr/__init__.py", "jaxrlvr.fam": "x/fam/__init__.py", "jaxrlvr.fam.inner": "x/fam/inner.py",
             "jaxrlvr.loop": "x/loop.py"}
  graph = {"jaxrlvr": set(), "jaxrlvr.fam": {"jaxrlvr.fam.inner"}, "jaxrlvr.fam.inner": set(),
           "jaxrlvr.loop": {"jaxrlvr.fam.inner", "jaxrlvr.fam"}}
  assert private_imports(modules, graph) == ["jaxrlvr.loop -> jaxrlvr.fam.inner"]


def test_modules_outside_a_family_import_only_its_face():
  found = private_imports()
  assert not found, "import the family's __init__ instead:\n" + "\n".join(found)
