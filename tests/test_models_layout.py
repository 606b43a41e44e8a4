"""The layout of `mars_jax/models/`: its modules import one another without a cycle, and
none is 600 lines or longer."""

import ast
import pathlib

MODELS = pathlib.Path(__file__).parents[1] / "mars_jax" / "models"
PACKAGE = "mars_jax.models"
MAX_LINES = 600


def _imports(path: pathlib.Path) -> set[str]:
  """The modules of `mars_jax.models` that `path` imports (`import a.b`, `from a.b import
  c`, `from a import b`), by their names within the package."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module:
      names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
  return {n.removeprefix(PACKAGE + ".").split(".")[0] for n in names
          if n.startswith(PACKAGE + ".")}


def test_models_import_one_another_without_a_cycle():
  modules = {p.stem: p for p in MODELS.glob("*.py")}
  graph = {m: _imports(p) & modules.keys() - {m} for m, p in modules.items()}
  assert "qwen2" not in graph["splash"]     # the model's helpers, never the model
  assert "qwen2" in graph["cached"] and "cached" not in graph["qwen2"]
  done: set[str] = set()

  def visit(module: str, path: tuple[str, ...]) -> None:
    assert module not in path, f"import cycle: {' -> '.join(path + (module,))}"
    if module not in done:
      for dep in graph[module]:
        visit(dep, path + (module,))
      done.add(module)

  for module in graph:
    visit(module, ())


def test_no_models_module_reaches_600_lines():
  lines = {p.name: len(p.read_text().splitlines()) for p in MODELS.rglob("*.py")}
  assert {n: k for n, k in lines.items() if k >= MAX_LINES} == {}
