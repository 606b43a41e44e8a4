"""`python -m mars_jax.plan --config configs/X.py --topology v5p-8 [--decode B,S,W]`.

Compiles the config's train step and eval step for a TPU slice or GPU node on any
host (no accelerator: compile-only devices, `mars_jax.parallel.hardware`), and reports per
chip what the compiler allocates against the chip's memory:

  args        params + optimizer state (+ the batch) as the mesh shards them
  temps       everything the step allocates while it runs (activations, gradients)
  total       args + temps + generated code + the outputs that do not reuse a donated
              argument (the train step's new state reuses the old one's buffers)

When the step does not fit, the micro-batch count is doubled while the batch still
splits evenly, compiling each (then the same with remat "full"), and the first that
fits is reported. The
step's FLOPs come from the model (`benchmarks.step.train_flops`: dense attention,
forward + backward; the compiler's cost analysis counts a loop body once), and
give the step time at 100% and 50% MFU on the chip's bf16 peak.

With `--decode BATCH,CACHE,W` it also compiles the decoding loop
(`mars_jax.decoding.mesh.lower_decode`) on a mesh of its own (`--decode_mesh`,
default tensor parallel over every chip) and reports its per-chip bytes and the
HBM roofline: one forward reads at least the chip's weight shard and, with the
cache full, its shard of the KV cache, so forwards/s <= bandwidth / those bytes; AR
commits `BATCH` tokens per forward, a window W at most `BATCH * W`.

The table goes to stdout and the same figures, as JSON, to `--out` (default
plans/<config>_<topology>.json, or plans/<config>_<topology>_decode.json with
`--notrain`, the decoding loop alone). A config's model is read from model.init's
config.json when that directory exists here, else from model.preset (+ overrides).
Errors (an unknown topology, a mesh that does not divide the chips, a missing
compiler) print one line, `error: ...`, and exit with status 2.
"""

from __future__ import annotations

import json
import os

import jax
from absl import flags
from ml_collections import config_flags

from mars_jax.benchmarks.plan import format_table, plan
from mars_jax.core import cli


def _decode_arg(text: str) -> tuple[int, int, int]:
  try:
    b, s, w = (int(v) for v in text.split(","))
  except ValueError:
    raise ValueError(f"--decode={text!r}; expected BATCH,CACHE,W, e.g. 1,1024,5.") from None
  if min(b, s, w) < 1:
    raise ValueError(f"--decode={text!r}; every number must be >= 1.")
  return b, s, w


def main(argv=None) -> None:

  config_flag = config_flags.DEFINE_config_file("config", None, "experiment config file",
                                                lock_config=True)
  topology_flag = flags.DEFINE_string(
      "topology", None, "TPU slice (v5p-8, v5e-16, v6e-8, v5p:2x2x1) or GPU node (h100-8, "
      "h200-8, a100-80-8, b200-8)")
  decode_flag = flags.DEFINE_string("decode", None, "also the decoding loop: BATCH,CACHE,W")
  decode_mesh_flag = flags.DEFINE_string("decode_mesh", "tensor=-1",
                                         "mesh of the decoding loop, e.g. data=2,tensor=4")
  out_flag = flags.DEFINE_string("out", None, "JSON path (default plans/<config>_<topology>"
                                 ".json; with --notrain, ..._decode.json)")
  search_flag = flags.DEFINE_bool("search", True, "when the step does not fit, compile "
                                  "more micro-batches / remat full until one fits")
  train_flag = flags.DEFINE_bool("train", True, "the train and eval steps (--notrain: "
                                 "the decoding loop only)")

  def run(_):
    jax.config.update("jax_platforms", os.environ.get("JAX_PLATFORMS") or "cpu")
    name = os.path.splitext(os.path.basename(
        config_flags.get_config_filename(flags.FLAGS["config"])))[0]
    with cli.one_line_errors((ValueError, FileNotFoundError)):
      report = plan(config_flag.value, name, topology_flag.value,
                    decode=_decode_arg(decode_flag.value) if decode_flag.value else None,
                    decode_mesh_spec=decode_mesh_flag.value, search=search_flag.value,
                    train=train_flag.value)
    print(format_table(report))
    suffix = "" if train_flag.value else "_decode"
    out = out_flag.value or os.path.join("plans", f"{name}_{topology_flag.value}{suffix}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
      json.dump(report, f, indent=1)
    print(f"wrote {out}")

  cli.run(run, argv=argv, required=("config", "topology"))


if __name__ == "__main__":
  main()
