"""The package's imports run one way, down the layers of docs/layout.md: read from the
source (imports inside functions count), no circle, no module importing from a layer
above its own, no alias module, a root that holds only the front doors, and no module of
600 lines or more."""

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mars_jax")

# Bottom to top; a module may import from its own layer and the layers below it. The
# root's modules (the front doors and the two entry modules) are the top layer.
LAYERS = (
    ("core",),
    ("models",),
    ("parallel",),
    ("checkpoints",),
    ("data",),
    ("training", "decoding"),
    ("evaluation",),
    ("experiments",),
    ("serve", "benchmarks"),
)
FRONT_DOORS = {"train", "generate", "evaluate", "export", "plan", "study", "bench", "lm_eval"}
ENTRY_MODULES = {"hf", "sampling"}  # what outside code imports: load_pretrained, generate


def _modules() -> dict[str, str]:
  """Dotted module name -> file, for every module of the package."""
  mods = {}
  for folder, _, files in os.walk(ROOT):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(folder, f)
        rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
        mods[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
  return mods


def _imports(name: str, path: str, mods: dict[str, str]) -> set[str]:
  """The package's modules that `name` imports anywhere in its file (a package's own
  __init__ importing its submodules is not an edge)."""
  tree = ast.parse(open(path).read())
  package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
  targets = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      targets.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
      targets.add(base)
      targets.update(f"{base}.{a.name}" for a in node.names)
  found = set()
  for t in targets:
    while t and t not in mods:
      t = t.rpartition(".")[0]
    if t and t != name and not (path.endswith("__init__.py") and t.startswith(name + ".")):
      found.add(t)
  return found


MODS = _modules()
GRAPH = {m: _imports(m, p, MODS) for m, p in MODS.items()}


def _layer(module: str) -> int:
  """The layer index of a module (len(LAYERS) for the root's)."""
  parts = module.split(".")
  if len(parts) == 2 and parts[1] in FRONT_DOORS | ENTRY_MODULES:
    return len(LAYERS)
  for i, packages in enumerate(LAYERS):
    if len(parts) > 1 and parts[1] in packages:
      return i
  raise AssertionError(f"{module} belongs to no layer: place its package in LAYERS and in "
                       "docs/layout.md, or make it a front door.")


def test_every_module_has_a_layer():
  for m in MODS:
    if m != "mars_jax":
      _layer(m)


def test_no_import_runs_up():
  up = sorted(f"{m} -> {t}" for m, ts in GRAPH.items() if m != "mars_jax"
              for t in ts if t != "mars_jax" and _layer(t) > _layer(m))
  assert not up, "imports from a layer above (move the shared piece down):\n" + "\n".join(up)


def test_no_circle():
  index, low, stack, on_stack, circles = {}, {}, [], set(), []

  def visit(v):  # Tarjan's strongly connected components
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in GRAPH[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        circles.append(" <-> ".join(sorted(component)))

  for v in GRAPH:
    if v not in index:
      visit(v)
  assert not circles, "import circles:\n" + "\n".join(circles)


def test_no_alias_modules():
  aliases = sorted(m for m, p in MODS.items() if "sys.modules[" in open(p).read())
  assert not aliases, f"modules that rewrite sys.modules: {aliases}"


def test_the_root_holds_the_front_doors():
  root = {m.split(".")[1] for m in MODS if m.count(".") == 1 and m.split(".")[1] not in
          {p for layer in LAYERS for p in layer}}
  assert root == FRONT_DOORS | ENTRY_MODULES, (
      f"library modules at the root: {sorted(root - FRONT_DOORS - ENTRY_MODULES)}")
  for name in FRONT_DOORS:
    assert "def main(" in open(os.path.join(ROOT, f"{name}.py")).read(), name


def test_entry_modules_are_their_homes():
  # pylint: disable=import-outside-toplevel
  from mars_jax import hf, sampling
  from mars_jax.checkpoints import hf as hf_home
  from mars_jax.decoding import sampler
  assert (hf.load_pretrained, hf.save_pretrained, hf.load_tokenizer) == (
      hf_home.load_pretrained, hf_home.save_pretrained, hf_home.load_tokenizer)
  assert sampling.generate is sampler.generate


@pytest.mark.parametrize("imported,importer", [("mars_jax.serve.engine", "mars_jax.serve.app"),
                                               ("mars_jax.checkpoints.runs",
                                                "mars_jax.decoding.loading")])
def test_the_graph_sees_known_edges(imported, importer):
  """The reader finds real imports (a reader that found none would pass every test)."""
  assert imported in GRAPH[importer]


def test_the_model_helpers_never_import_the_model():
  assert "mars_jax.models.qwen2" not in GRAPH["mars_jax.models.splash"]
  assert "mars_jax.models.qwen2" in GRAPH["mars_jax.models.cached"]


def test_no_module_reaches_600_lines():
  """A file of 600 lines or more holds two jobs (docs/layout.md)."""
  lines = {m: len(open(p).read().splitlines()) for m, p in MODS.items()}
  assert {m: n for m, n in lines.items() if n >= 600} == {}
