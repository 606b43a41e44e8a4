"""The decoding benches run end to end on the trained toy, as the README shows them."""

import json

import pytest

from mars_jax.benchmarks import decode_cost, sample


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


def test_bench_decode_on_the_toy(capsys):
  decode_cost.main(["--model", "toy", "--batch-sizes", "2", "--windows", "1,3",
                    "--cache-len", "64", "--steps", "4"])
  lines = capsys.readouterr().out.strip().splitlines()
  assert "GFLOP/s" in lines[0] and len(lines) == 4
  assert [line.split()[:3] for line in lines[2:]] == [["2", "1", "2"], ["2", "3", "10"]]
