"""No import cycles inside the package: every arrow between jaxrlvr modules runs one way.

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
  modules = _modules()
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
