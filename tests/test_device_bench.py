"""`python -m mars_jax.bench device` (the accelerator check's figures): its smoke run, so
the GPU run cannot rot (in the slow set: `pytest -m slow`), and its budget guard, chip
table and byte counts."""

import json
import os
import subprocess
import sys

import pytest

from mars_jax.benchmarks import device, roofline
from mars_jax.models import qwen2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # end to end: every section of the device bench, CPU-sized
def test_smoke_runs_every_section(tmp_path):
  """Every section's code path on tiny shapes, in a subprocess as the shell runs it
  (XLA's CPU backend unoptimised: compiling is most of the time, the speed is moot)."""
  out = tmp_path / "dev"
  flags = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
  r = subprocess.run([sys.executable, "-m", "mars_jax.bench", "device", "--smoke", "--out",
                      str(out), "--peak-tflops", "1", "--hbm-tbps", "0.05"],
                     capture_output=True, text=True, cwd=ROOT,
                     env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags.strip()})
  assert r.returncode == 0, r.stdout + r.stderr
  data = json.loads((out / "device.json").read_text())
  assert data["meta"]["smoke"] and data["meta"]["chip"]["peak_bf16_tflops_source"] == "flag"
  for name in device.SECTIONS:
    assert not data[name]["errors"] and not data[name]["skipped"], data[name]
  train = {r["objective"]: r for r in data["train"]["rows"]}
  assert set(train) == {"ar_sft", "mars"} and train["mars"]["x_ar"] > 0
  assert 0 < train["mars"]["mfu"] and train["mars"]["positions"] == 2 * train["ar_sft"]["positions"]
  rows = {(r["window"], r["tau"]): r for r in data["decode"]["rows"]}
  assert set(rows) == {(w, t) for _, w, t in device.DECODE_ROWS}
  assert rows[(1, 1.0)]["tokens_per_forward"] == 1.0 == rows[(5, 1.0)]["tokens_per_forward"]
  assert rows[(5, 0.0)]["tokens_per_forward"] > 1.0 and rows[(1, 1.0)]["same_as_ar"] == 1.0
  assert all(r["roofline_ms_per_forward"] > 0 for r in data["decode"]["rows"])
  big = data["decode_7b"]["rows"]
  assert [r["window"] for r in big] == list(device.SMOKE.big_windows)
  assert big[0]["x_ar_forward"] == 1.0 and big[0]["roofline_fraction"] > 0
  md = (out / "device.md").read_text()
  for title in ("## Train step", "## Decoding: our AR loop vs MARS", "## Decoding a 7B shape"):
    assert title in md


def test_budget_skips_items_and_says_so(tmp_path, capsys):
  """A section with no time left starts nothing: each item is listed as skipped."""
  device.main(["--out", str(tmp_path), "--smoke", "--limits", "train=0,decode=0,decode_7b=0"])
  assert "train: init params: skipped" in capsys.readouterr().out
  data = json.loads((tmp_path / "device.json").read_text())
  for name in device.SECTIONS:
    assert data[name]["rows"] == [] and len(data[name]["skipped"]) == 1
  md = (tmp_path / "device.md").read_text()
  assert "- skipped: decode_7b: init params: skipped" in md
  assert "Peak dense bf16: unknown TFLOP/s (unknown)" in md  # a CPU is not in the table


def test_report_merges_and_adds_the_shell_log(tmp_path):
  device.main(["--out", str(tmp_path), "--smoke", "--sections", "train", "--limits",
               "train=0"])
  device.main(["--out", str(tmp_path), "--smoke", "--merge", "--sections", "decode",
               "--limits", "decode=0"])
  (tmp_path / "sections.tsv").write_text("tests\t75\t41\tok\t15 passed in 30s\n")
  device.main(["--out", str(tmp_path), "--report"])
  data = json.loads((tmp_path / "device.json").read_text())
  assert "train" in data and "decode" in data and "decode_7b" not in data
  assert data["sections"][0]["detail"] == "15 passed in 30s"
  assert "| tests | 75 | 41 | ok | 15 passed in 30s |" in (tmp_path / "device.md").read_text()


def test_chip_figures():
  h200 = device.chip_figures("NVIDIA H200")
  assert (h200["peak_bf16_tflops"], h200["hbm_tbps"]) == (989.0, 4.8)
  assert h200["hbm_tbps_source"] == "table (NVIDIA H200)"
  other = device.chip_figures("Some Accelerator", hbm_tbps=2.0)
  assert other["peak_bf16_tflops"] is None and other["peak_bf16_tflops_source"] == "unknown"
  assert (other["hbm_tbps"], other["hbm_tbps_source"]) == (2.0, "flag")
  assert device.roofline_ms(4_800_000_000, None) is None
  assert abs(device.roofline_ms(4_800_000_000, 4.8) - 1.0) < 1e-9


def test_forward_bytes_7b_and_tied():
  rt = qwen2.Runtime(param_dtype="bfloat16", dtype="bfloat16")
  config = qwen2.preset("qwen2.5-7b")
  params, kv = roofline.forward_bytes(config, rt, 1, 1024)
  total = qwen2.num_params(qwen2.abstract_params(config, runtime=rt))
  # untied: every weight but the embedding table, 2 bytes each
  assert params == 2 * (total - config.vocab_size * config.hidden_size)
  assert kv == 2 * 28 * 1024 * 4 * 128 * 2
  small = qwen2.preset("qwen2.5-0.5b")  # tied: the table is the unembedding, read whole
  p, _ = roofline.forward_bytes(small, rt, 1, 8)
  assert p == 2 * 494_032_768
