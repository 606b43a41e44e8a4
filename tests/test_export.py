"""Export never deletes what it did not write: foreign, earlier-export and in-run --out."""

import json
import os

import jax
import numpy as np
import pytest

from mars_jax import export
from mars_jax.checkpoints import hf
from mars_jax.decoding import loading
from mars_jax.training import checkpoint
from mars_jax.checkpoints import runs
from mars_jax.models.qwen2 import Qwen2Config, Runtime, init_params

CONFIG = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, bos_token_id=None,
                     eos_token_id=2, tie_word_embeddings=True)
OBJECTIVE = {"kind": "mars", "block_size": 3, "ar_weight": 1.0, "intra_block": "causal",
             "normalization": "sequence"}


@pytest.fixture(scope="module")
def params():
  return init_params(CONFIG, jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def run(tmp_path_factory, params):
  """A real run directory with one checkpoint (step 1) of the tiny model."""
  d = str(tmp_path_factory.mktemp("run") / "run")
  runs.write_layout(d, {**runs.model_layout(CONFIG, Runtime()),
                              "objective": OBJECTIVE})
  ck = checkpoint.RunCheckpointer(d, async_save=False)
  ck.save(1, params, {"count": np.zeros((), np.int32)}, {"epoch": 0}, force=True)
  ck.close()
  return d


def fake_run(root):
  """A run directory that resolve_checkpoint accepts (refusals happen before loading)."""
  d = root / "fake_run"
  (d / "checkpoints" / "3").mkdir(parents=True)
  (d / "layout.json").write_text(json.dumps({"objective": OBJECTIVE}))
  (d / "checkpoints" / "3" / "keep.txt").write_text("step 3")
  return d


def run_intact(d):
  return ((d / "layout.json").is_file()
          and (d / "checkpoints" / "3" / "keep.txt").read_text() == "step 3")


def leftovers(parent):
  return [p for p in os.listdir(parent) if p.startswith((".tmp-export-", ".old-export-"))]


def test_foreign_nonempty_dir_is_refused_and_untouched(tmp_path, params):
  out = tmp_path / "mine"
  out.mkdir()
  (out / "notes.txt").write_text("precious")
  with pytest.raises(hf.ExportTargetError, match="not a mars_jax export"):
    hf.save_pretrained(CONFIG, params, str(out), overwrite=True)
  assert os.listdir(out) == ["notes.txt"] and (out / "notes.txt").read_text() == "precious"
  assert not leftovers(tmp_path)


def test_empty_dir_is_fine_and_every_export_has_a_marker(tmp_path, params):
  out = tmp_path / "empty"
  out.mkdir()
  hf.save_pretrained(CONFIG, params, str(out), source={"objective": OBJECTIVE})
  marker = hf.read_export_marker(str(out))
  assert marker["dtype"] == "float32" and marker["source"]["objective"] == OBJECTIVE
  assert set(marker["files"]) | {hf.EXPORT_MARKER} == set(os.listdir(out))
  assert "model.safetensors" in marker["files"]


def test_earlier_export_needs_overwrite(tmp_path, params):
  out = str(tmp_path / "hf")
  hf.save_pretrained(CONFIG, params, out)
  with pytest.raises(hf.ExportTargetError, match="pass --overwrite"):
    hf.save_pretrained(CONFIG, params, out, dtype="bfloat16")
  assert hf.read_export_marker(out)["dtype"] == "float32"
  hf.save_pretrained(CONFIG, params, out, dtype="bfloat16", overwrite=True)
  assert hf.read_export_marker(out)["dtype"] == "bfloat16"
  assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"
  assert not leftovers(tmp_path)


@pytest.mark.parametrize("marker", ['{"format": "something else"}', "not json", None])
def test_a_dir_without_a_valid_marker_is_never_replaced(tmp_path, params, marker):
  out = tmp_path / "hf"
  hf.save_pretrained(CONFIG, params, str(out))
  os.remove(out / hf.EXPORT_MARKER)
  if marker is not None:
    (out / hf.EXPORT_MARKER).write_text(marker)
  before = sorted(os.listdir(out))
  with pytest.raises(hf.ExportTargetError, match="not a mars_jax export"):
    hf.save_pretrained(CONFIG, params, str(out), overwrite=True)
  assert sorted(os.listdir(out)) == before and not leftovers(tmp_path)


def test_a_file_as_out_is_refused(tmp_path, params):
  out = tmp_path / "model.bin"
  out.write_bytes(b"x")
  with pytest.raises(hf.ExportTargetError, match="not a directory"):
    hf.save_pretrained(CONFIG, params, str(out), overwrite=True)
  assert out.read_bytes() == b"x"


def test_failed_overwrite_keeps_the_old_export(tmp_path, params):
  out = str(tmp_path / "hf")
  hf.save_pretrained(CONFIG, params, out)
  before = sorted(os.listdir(out))
  broken = {k: v for k, v in params.items() if k != "final_norm"}
  with pytest.raises(KeyError):
    hf.save_pretrained(CONFIG, broken, out, overwrite=True)
  assert sorted(os.listdir(out)) == before and hf.read_export_marker(out)
  assert not leftovers(tmp_path)


@pytest.mark.parametrize("where", ["run", "inside", "step_dir", "contains"])
def test_out_in_or_around_the_run_is_refused(tmp_path, where):
  d = fake_run(tmp_path)
  out = {"run": d, "inside": d / "hf", "step_dir": d / "checkpoints" / "3",
         "contains": tmp_path}[where]
  want = "contains the run" if where == "contains" else "inside the run|is the run"
  for overwrite in (False, True):
    with pytest.raises(hf.ExportTargetError, match=want):
      export.export(str(d), str(out), overwrite=overwrite)
    with pytest.raises(hf.ExportTargetError, match=want):
      export.export(str(d / "checkpoints" / "3"), str(out), overwrite=overwrite)
  assert run_intact(d) and not (d / "hf").exists()


@pytest.mark.parametrize("where", ["source", "inside", "contains"])
def test_out_in_or_around_the_source_model_is_refused(tmp_path, params, where):
  """The model a run started from (layout.json's init) is protected even when it is an
  earlier export and --overwrite is given."""
  src = tmp_path / "models" / "base"
  hf.save_pretrained(CONFIG, params, str(src))
  d = fake_run(tmp_path)
  (d / "layout.json").write_text(json.dumps({"objective": OBJECTIVE, "init": str(src)}))
  out = {"source": src, "inside": src / "sub", "contains": tmp_path / "models"}[where]
  before = sorted(os.listdir(src))
  with pytest.raises(hf.ExportTargetError, match="the model the run started from"):
    export.export(str(d), str(out), overwrite=True)
  assert sorted(os.listdir(src)) == before and run_intact(d)


def test_cli_refuses_foreign_out_clearly(tmp_path, capsys):
  d = fake_run(tmp_path)
  out = tmp_path / "data"
  out.mkdir()
  (out / "x.bin").write_bytes(b"\0")
  with pytest.raises(SystemExit) as e:
    export.main(["--checkpoint", str(d), "--out", str(out), "--overwrite"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and hf.EXPORT_MARKER in err and "Traceback" not in err
  assert os.listdir(out) == ["x.bin"] and run_intact(d)
  with pytest.raises(SystemExit) as e:
    export.main(["--checkpoint", str(d), "--out", str(d / "hf")])
  assert e.value.code == 2 and "outside the run" in capsys.readouterr().err


def test_cli_export_then_overwrite(run, tmp_path, capsys):
  out = str(tmp_path / "hf")
  export.main(["--checkpoint", run, "--out", out])
  marker = hf.read_export_marker(out)
  assert marker["source"]["step"] == 1 and marker["source"]["objective"] == OBJECTIVE
  assert loading.trained_block_size(out) == loading.trained_block_size(run) == 3
  _, params = hf.load_pretrained(out)
  _, _, ref = runs.load_params(run)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), jax.device_get(ref))
  capsys.readouterr()
  with pytest.raises(SystemExit) as e:
    export.main(["--checkpoint", run, "--out", out, "--dtype", "bfloat16"])
  assert e.value.code == 2 and "--overwrite" in capsys.readouterr().err
  export.main(["--checkpoint", run, "--out", out, "--dtype", "bfloat16", "--overwrite"])
  assert hf.read_export_marker(out)["dtype"] == "bfloat16"
  assert os.path.isfile(os.path.join(run, "layout.json"))
  assert not leftovers(tmp_path)


@pytest.mark.slow
def test_rerun_of_a_finished_training_reexports(tmp_path):
  """The train CLI writes WORKDIR/hf with the marker; a rerun replaces it (its own export)
  and still refuses, before training, a WORKDIR/hf it did not write."""
  import subprocess
  import sys
  from test_train import ROOT, SMALL
  cmd = [sys.executable, "-m", "mars_jax.train", *SMALL, "--config.train.steps=1",
         "--config.train.export_hf=True", f"--workdir={tmp_path}/w"]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
  for _ in range(2):
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    marker = hf.read_export_marker(str(tmp_path / "w" / "hf"))
    assert marker["source"]["objective"]["kind"] == "mars"
  assert loading.trained_block_size(str(tmp_path / "w" / "hf")) == marker["source"][
      "objective"]["block_size"]
  foreign = tmp_path / "w2"
  (foreign / "hf").mkdir(parents=True)
  (foreign / "hf" / "notes.txt").write_text("mine")
  r = subprocess.run(cmd[:-1] + [f"--workdir={foreign}"], env=env, cwd=ROOT,
                     capture_output=True, text=True)
  assert r.returncode != 0 and "not a mars_jax export" in r.stderr
  assert os.listdir(foreign / "hf") == ["notes.txt"]
  assert os.listdir(foreign) == ["hf"]  # refused before training, not after


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
  """An HF directory as exports wrote it before `pard_token`: the toy's (random weights,
  its tokenizer with `<|mask|>`, a MARS record of block size 4), the key taken out."""
  from mars_jax.benchmarks import toy
  t = toy.Toy(toy.CONFIG, init_params(toy.CONFIG, jax.random.PRNGKey(1)),
              np.arange(1, toy.PERIOD + 1), toy.MASK_ID, 4)
  d = str(tmp_path_factory.mktemp("toy") / "hf")
  toy.export(t, d)
  config = json.load(open(os.path.join(d, "config.json")))
  assert config.pop("pard_token") == toy.MASK_ID   # what every MARS export writes now
  json.dump(config, open(os.path.join(d, "config.json"), "w"))
  return d


def test_a_hugging_face_directory_is_exported_with_pard_token(toy_dir, tmp_path, capsys):
  """`--checkpoint HF_DIR`: the same weights, tokenizer, records and config keys, with
  `pard_token` (the `<|mask|>` id) in config.json, which transformers keeps; the log
  prints the vLLM command with K = B + 1 and the absolute path; --dtype converts;
  --adapter, an --out inside the source and a model that is not MARS are refused, with
  nothing written."""
  import shutil
  import tokenizers
  import transformers
  from mars_jax.checkpoints import vllm_recipe
  config = json.load(open(os.path.join(toy_dir, "config.json")))
  json.dump({**config, "pad_token_id": 0}, open(os.path.join(toy_dir, "config.json"), "w"))
  out = str(tmp_path / "ready")
  os.chdir(tmp_path)
  export.main(["--checkpoint", toy_dir, "--out", "ready"])
  log = capsys.readouterr().out
  tok = transformers.AutoTokenizer.from_pretrained(out)
  assert tok.get_vocab() == transformers.AutoTokenizer.from_pretrained(toy_dir).get_vocab()
  hf_config = transformers.AutoConfig.from_pretrained(out)
  assert hf_config.pard_token == tok.convert_tokens_to_ids(hf.MASK_TOKEN) == 127
  assert hf_config.pad_token_id == 0
  assert vllm_recipe.serve_command(out, 5) in log
  _, got = hf.load_pretrained(out)
  _, want = hf.load_pretrained(toy_dir)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(got), jax.device_get(want))
  marker = hf.read_export_marker(out)
  assert marker["source"]["objective"] == {"kind": "mars", "block_size": 4}
  assert marker["source"]["hf_dir"] == os.path.realpath(toy_dir)
  assert hf.read_generation_config(out) == hf.read_generation_config(toy_dir)
  export.main(["--checkpoint", toy_dir, "--out", out, "--dtype", "bfloat16", "--overwrite"])
  assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"
  with open(os.path.join(out, "model.safetensors"), "rb") as f:   # the file's header
    header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
  assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
  capsys.readouterr()
  plain = tmp_path / "plain"                      # a tokenizer without <|mask|>
  plain.mkdir()
  for name in ("config.json", "model.safetensors"):
    shutil.copy(os.path.join(toy_dir, name), plain / name)
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "<unk>": 1}, "<unk>"))
  transformers.PreTrainedTokenizerFast(tokenizer_object=backend,
                                       unk_token="<unk>").save_pretrained(plain)
  for argv, says in [(["--checkpoint", toy_dir, "--out", "a", "--adapter"], "LoRA runs"),
                     (["--checkpoint", toy_dir, "--out", os.path.join(toy_dir, "in")],
                      "outside the run"),
                     (["--checkpoint", str(plain), "--out", "a"],
                      f"its tokenizer has no {hf.MASK_TOKEN}")]:
    with pytest.raises(SystemExit) as e:
      export.main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err
  assert not os.path.exists(tmp_path / "a") and not leftovers(tmp_path)


def test_only_a_mars_model_gets_pard_token():
  """`hf.pard_token_of`: the `<|mask|>` id when the tokenizer has it and the record names
  MARS or nothing; None for an AR-SFT run, or without a tokenizer (a tokenizer without
  `<|mask|>`: the test above)."""
  from mars_jax.benchmarks import toy
  tok = toy.tokenizer()
  assert hf.pard_token_of({"kind": "mars", "block_size": 4}, tok) == toy.MASK_ID
  assert hf.pard_token_of(None, tok) == toy.MASK_ID
  assert hf.pard_token_of({"kind": "ar_sft", "block_size": 4}, tok) is None
  assert hf.pard_token_of({"kind": "mars"}, None) is None
