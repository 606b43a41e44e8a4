"""The benches run end to end: decoding on the trained toy, the train step on a tiny shape."""

import json
import os
import subprocess

import pytest

from mars_jax.benchmarks import (decode_cost, sample, serve_load, serve_peers, serve_prompts,
                                 speculative, step)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # ~40 s; the closing notes run the README's bench commands as written
def test_bench_sample_on_the_toy(tmp_path, capsys):
  out = tmp_path / "bench.json"
  sample.main(["--model", "toy", "--batch-sizes", "2", "--windows", "1,3", "--taus", "0.9",
               "--repeats", "1", "--max-new-tokens", "12", "--prompt-len", "4",
               "--out", str(out)])
  rows = {(r["impl"], r["window"]): r for r in json.loads(out.read_text())["rows"]}
  assert {("ours AR", 1), ("transformers", 1), ("ours MARS", 3), ("ours lossless", 3),
          ("auto MARS", "auto"), ("auto lossless", "auto")} <= set(rows)
  # the peer and our lossless loop reproduce our AR loop's tokens exactly
  assert rows[("transformers", 1)]["same_tokens_as_ours_ar"] == 1.0
  assert rows[("ours lossless", 3)]["same_tokens_as_ours_ar"] == 1.0
  assert rows[("ours MARS", 3)]["tokens_per_forward"] > 1.5  # the toy's proposals are right
  assert all(r["tokens_per_s"] > 0 and r["roofline_tokens_per_s"] > 0 for r in rows.values())
  assert "roof tok/s" in capsys.readouterr().out


@pytest.mark.e2e  # a benchmark run as the README gives it
def test_bench_decode_on_the_toy(capsys):
  decode_cost.main(["--model", "toy", "--batch-sizes", "2", "--windows", "1,3",
                    "--cache-len", "64", "--steps", "4",
                    "--sampling", "top_k=5,top_p=0.8,temperature=0.7"])
  lines = capsys.readouterr().out.strip().splitlines()
  assert "GFLOP/s" in lines[0] and len(lines) == 4
  assert [line.split()[:3] for line in lines[2:]] == [["2", "1", "2"], ["2", "3", "10"]]
  for row in (line.split() for line in lines[2:]):   # sampled ms, x greedy
    assert float(row[-1]) == pytest.approx(float(row[-2]) / float(row[3]), rel=0.01)


@pytest.mark.e2e  # a benchmark run as the README gives it
def test_bench_step_tiny_shape_unrolled(capsys):
  step.main(["--scenarios", "prompt-heavy", "--hidden", "32", "--layers", "2", "--heads", "2",
             "--kv-heads", "1", "--intermediate", "64", "--vocab", "128", "--batch", "2",
             "--length", "32", "--steps", "1", "--rounds", "1", "--no-peer", "--no-scan",
             "--mem-vocabs", "256", "--mem-lengths", "16", "--mem-batch", "1",
             "--mem-hidden", "16"])
  out = capsys.readouterr().out
  assert "scan_layers=False" in out.splitlines()[0]
  rows = {line.split(",")[0].split("  ")[0]: line.split() for line in out.splitlines()
          if line.startswith("ours ")}
  assert set(rows) == {"ours ar_sft", "ours mars"}
  assert all(float(r[-3]) > 0 for r in rows.values())        # ms/step measured
  assert "naive/chunked" in out


@pytest.mark.slow  # ~2 min on 2 cores with the compilation cache warm, 6-9 min cold
def test_bench_serve_smoke(tmp_path):
  """Our two server kinds (no peer) and the in-process engine under 1 and 2 users, on a
  random model with the real Qwen2.5 vocabulary and chat template: every figure there."""
  from qwen_tokenizers import make_qwen_checkpoint  # pylint: disable=import-outside-toplevel
  out, png = tmp_path / "serve.json", tmp_path / "serve.png"
  serve_load.main(["--model", make_qwen_checkpoint(tmp_path / "hf", "qwen2.5"),
                   "--work-dir", str(tmp_path), "--concurrency", "1,2", "--duration-s", "1",
                   "--warm-s", "0.5", "--max-tokens", "8", "--peer", "none",
                   "--batch-size", "2", "--windows", "1,2", "--max-len", "80",
                   "--in-process", "2", "--out", str(out), "--plot", str(png)])
  result = json.loads(out.read_text())
  assert result["prompts"] == "chat" and png.stat().st_size > 0
  assert set(result["servers"]) == {"auto", "w1"}
  for server in result["servers"].values():
    assert server["exit_code"] == 0 and server["compiles_after_ready"] >= 0
  assert [r["concurrency"] for r in result["rows"]] == [1, 2]
  figures = {"requests_per_s", "output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms",
             "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms", "itl_p99_ms", "rows_per_forward",
             "tokens_per_forward"}
  for row in result["rows"]:
    for kind in ("auto", "w1"):
      point = row[kind]
      assert figures | {"compiles_timed"} <= set(point)
      assert point["failed"] == 0 and point["output_tokens_per_s"] > 0
      assert point["tokens_from"] == {"usage": point["requests"]}  # our usage chunk
      assert point["rows_per_forward"] > 0 and point["tokens_per_forward"] >= 1
  local = result["rows"][1]["auto_in_process"]
  assert figures <= set(local) and local["output_tokens_per_s"] > 0


def test_bench_serve_peer_list():
  """--peer: a comma list of transformers, vllm and vllm-mars (default the first two),
  each once, or none alone; anything else is refused."""
  def peers(*argv):
    return serve_load.parser().parse_args(list(argv)).peer
  assert peers() == ["transformers", "vllm"]
  assert peers("--peer", "vllm") == ["vllm"]
  assert peers("--peer", "vllm, transformers,vllm") == ["vllm", "transformers"]
  assert peers("--peer", "vllm-mars,vllm") == ["vllm-mars", "vllm"]
  assert peers("--peer", "none") == []
  for bad in ("vllm,none", "tgi", ""):
    with pytest.raises(SystemExit):
      peers("--peer", bad)


def test_bench_serve_vllm_peer_needs_its_venv(tmp_path, monkeypatch, capsys):
  """Without a finished vLLM venv the vllm peer is skipped in one line that names the
  command which builds it, and the other peers stay; with one, its command and
  environment. The bench finds the venv where launch/vllm_venv.sh puts it. vllm-mars
  also needs `pard_token` in the model's config.json, and runs the export's recipe."""
  model = tmp_path / "model"
  model.mkdir()
  (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
  monkeypatch.delenv("MARS_JAX_VLLM_VENV", raising=False)
  monkeypatch.setenv("HOME", str(tmp_path))
  script = subprocess.run(["bash", os.path.join(ROOT, "launch", "vllm_venv.sh"),
                           "--print-path"], capture_output=True, text=True, check=True)
  assert script.stdout.strip() == serve_peers.vllm_venv(None)
  assert serve_peers.vllm_venv(None).startswith(str(tmp_path / ".cache" / "mars_jax"))

  venv = tmp_path / "venv"
  monkeypatch.setenv("MARS_JAX_VLLM_VENV", str(venv))
  assert serve_peers.select(["transformers", "vllm"], None, str(model))[0] == ["transformers"]
  out = capsys.readouterr().out.splitlines()
  assert len(out) == 1 and out[0].startswith("vllm peer skipped: no vLLM venv at")
  assert out[0].endswith("build it with: bash launch/vllm_venv.sh")

  (venv / "bin").mkdir(parents=True)
  (venv / "bin" / "vllm").write_text("#!/bin/sh\n")
  (venv / "bin" / "vllm").chmod(0o755)
  peers, skipped = serve_peers.select(["vllm"], None, str(model))   # unfinished: no marker
  assert peers == [] and "did not finish its build" in skipped["vllm"]
  assert serve_peers.select(["vllm"], str(venv), str(model)) == (["vllm"], {})  # --vllm-venv
  (venv / serve_peers.VLLM_MARKER).write_text("built\n")
  assert serve_peers.select(["vllm", "transformers"], None, str(model)) == (
      ["vllm", "transformers"], {})
  peers, skipped = serve_peers.select(["vllm-mars", "vllm"], None, str(model))
  assert peers == ["vllm"] and "no pard_token" in skipped["vllm-mars"] and skipped["vllm-mars"].endswith("--model OUT")
  assert f"python -m mars_jax.export --checkpoint {model}" in skipped["vllm-mars"]
  (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "pard_token": 9}))
  assert serve_peers.select(["vllm-mars"], None, str(model)) == (["vllm-mars"], {})

  args = serve_load.parser().parse_args(["--max-len", "300"])
  name, command, env = serve_peers.launch_spec("vllm", "/m", 8123, args)
  assert name == "bench" and command == [
      str(venv / "bin" / "vllm"), "serve", "/m", "--dtype", "float32", "--max-model-len",
      "300", "--host", "127.0.0.1", "--port", "8123", "--served-model-name", "bench"]
  assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
  assert "--max-model-len 512" in " ".join(serve_peers.launch_spec(
      "vllm", "/m", 1, serve_load.parser().parse_args([]))[1])
  _, command, _ = serve_peers.launch_spec("vllm-mars", str(model), 8123, args)
  assert command[:5] == [str(venv / "bin" / "vllm"), "serve", str(model),
                         "--speculative-config", json.dumps(
                             {"method": "draft_model", "model": str(model),
                              "num_speculative_tokens": 5, "parallel_drafting": True})]
  assert command[5:] == ["--dtype", "float32", "--max-model-len", "300", "--host",
                         "127.0.0.1", "--port", "8123", "--served-model-name", "bench"]
  assert serve_peers.spec_decode(
      {}, {"vllm:spec_decode_num_drafts_total": 10, "vllm:spec_decode_num_draft_tokens_total":
           40, "vllm:spec_decode_num_accepted_tokens_total": 30}) == {
      "drafts": 10, "draft_tokens": 40, "accepted": 30, "acceptance": 0.75,
      "tokens_per_step": 4.0}


@pytest.mark.e2e  # a benchmark run as the README gives it
def test_bench_speculative_on_two_checkpoints(tmp_path, capsys):
  """Every row of `bench speculative` (here AR models in all four roles: two random
  checkpoints over one BPE tokenizer) decodes its target's greedy AR tokens."""
  import user_path_fixtures as fx  # pylint: disable=import-outside-toplevel
  texts = fx.task_texts(fx.task_records(60, seed=0))
  target = fx.make_qwen2_checkpoint(tmp_path / "target", texts=texts, seed=0)
  drafter = fx.make_qwen2_checkpoint(tmp_path / "drafter", texts=texts, hidden=16, layers=1,
                                     seed=1)
  out = tmp_path / "bench.json"
  speculative.main(["--ar-drafter", drafter, "--mars-drafter", drafter, "--ar-target", target,
                    "--mars-target", target, "--batch-sizes", "2", "--prompts", "2",
                    "--repeats", "1", "--max-new-tokens", "6", "--out", str(out)])
  rows = json.loads(out.read_text())["rows"]
  assert len(rows) == 7 and all(r["equal_to_ar"] and r["tokens_per_s"] > 0 for r in rows)
  assert [r["drafter_forwards_per_token"] > 0 for r in rows] == [False] * 3 + [True] * 4
  assert "| AR drafter + MARS target |" in capsys.readouterr().out


@pytest.mark.e2e  # a benchmark run as the README gives it
def test_bench_data_small(tmp_path, capsys):
  """`bench data` on 300 chats, ours with one build process (the peer, datasets' .map,
  adds ~30 s: `--skip-peer`): every chat kept, as many tokens as the model's tokenizer
  gives the chats rendered by its template (what the peer counts), the warm start
  read the cache without building anything and held one shard's two maps after 101
  batches; then `--stages` times each step of a build on the same chats."""
  from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel
  from mars_jax.benchmarks import data as data_bench  # pylint: disable=import-outside-toplevel
  out = tmp_path / "data.json"
  data_bench.main(["--chats", "300", "--workers-list", "1", "--work-dir", str(tmp_path),
                   "--skip-peer", "--out", str(out)])
  result = json.loads(out.read_text())
  assert [(r["system"], r["workers"]) for r in result["rows"]] == [("ours", 1)]
  row, warm = result["rows"][0], result["runs"][0]["warm"]
  tok = AutoTokenizer.from_pretrained(result["model_dir"])
  with open(result["chats"]["300"]["path"]) as f:
    texts = [tok.apply_chat_template(json.loads(line)["messages"], tokenize=False)
             for line in f]
  assert len(texts) == row["kept"] == 300 and row["bad"] == 0
  tokens = sum(map(len, tok(texts, add_special_tokens=False)["input_ids"]))
  assert row["tokens"] == tokens > 300 * 200   # ~340 a chat
  assert row["warm_cache_unchanged"] and warm["examples"] == 300
  assert warm["batch_shape"] == [32, 2048] and warm["batch_targets"] > 0
  assert row["cold_s"] > 0 and row["cold_peak_rss_mb"] > 0 and row["warm_first_batch_s"] > 0
  assert "| 300 | ours | 1 |" in capsys.readouterr().out
  assert warm["cache_maps_first_batch"] == warm["cache_maps_more_batches"] == 2
  assert warm["fds_more_batches"] < 64
  data_bench.main(["--stages", "100", "--chats", "300", "--work-dir", str(tmp_path),
                   "--out", str(out)])
  stages = json.loads(out.read_text())
  assert stages["chats"] == 100 and stages["tokens"] == sum(map(len, tok(
      texts[:100], add_special_tokens=False)["input_ids"]))
  assert all(s > 0 for s in stages["steps_s"].values()) and len(stages["steps_s"]) == 8
  assert "| tokenize and label (ours) |" in capsys.readouterr().out


def test_bench_serve_system_prompt_is_one_message_of_at_least_the_tokens_asked(tmp_path):
  """--system-prompt-tokens: the same system message before every chat, at least that
  many tokens by the model's own tokenizer (the real Qwen2.5 vocabulary here)."""
  from qwen_tokenizers import make_qwen_checkpoint  # pylint: disable=import-outside-toplevel
  from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel
  model = make_qwen_checkpoint(tmp_path / "hf", "qwen2.5")
  chats = [[{"role": "user", "content": "2+3?"}], [{"role": "user", "content": "Hi."}]]
  out = serve_prompts.with_system_prompt(chats, model, 300)
  assert [c[1:] for c in out] == chats
  assert out[0][0] == out[1][0] and out[0][0]["role"] == "system"
  tokens = len(AutoTokenizer.from_pretrained(model)(out[0][0]["content"]).input_ids)
  sentence = len(AutoTokenizer.from_pretrained(model)(serve_prompts.SYSTEM_SENTENCE).input_ids)
  assert 300 <= tokens < 300 + 2 * sentence
