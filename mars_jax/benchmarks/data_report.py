"""The tables of `python -m mars_jax.bench data` (mars_jax/benchmarks/data.py): one row a
(N, system, W) run, the speedups and the peer over ours, and the steps of `--stages`.

  rows = [row_of(n, system, w, {"cold": ..., "warm": ...}), ...]
  print_table({"rows": rows, "comparisons": comparisons(rows), ...})
"""

from __future__ import annotations

MORE_BATCHES = 100    # our warm start's batches after the first, before handles are counted
SYSTEMS = {"ours": "ours", "peer": "datasets.map"}


def row_of(n: int, system: str, workers: int, result: dict) -> dict:
  cold, warm = result["cold"], result["warm"]
  tokens = cold.get("tokens")
  wall = cold["wall_s"]
  return {
      "chats": n, "system": system, "workers": workers,
      "cold_s": wall, "kept": cold.get("kept"), "bad": cold.get("bad"), "tokens": tokens,
      "shards_built": cold.get("shards_built"),
      "chats_per_s": n / wall, "tokens_per_s": tokens / wall if tokens else None,
      "tokens_per_s_per_process": tokens / wall / workers if tokens else None,
      "cold_cpu_s": cold["cpu_s"], "cold_peak_rss_mb": cold["peak_rss_mb"],
      "cold_peak_pss_mb": cold["peak_pss_mb"], "cache_mb": cold["cache_bytes"] / 2**20,
      "warm_import_s": warm["import_s"], "warm_first_batch_s": warm["first_batch_s"],
      "warm_wall_s": warm["wall_s"], "warm_peak_rss_mb": warm["peak_rss_mb"],
      "warm_data_rss_mb": warm["data_rss_mb"],
      "warm_data_s": warm["first_batch_s"] - warm["tokenizer_s"],
      "warm_fds": warm.get("fds_first_batch"),
      "warm_cache_maps": warm.get("cache_maps_first_batch"),
      "warm_fds_more": warm.get("fds_more_batches"),
      "warm_cache_maps_more": warm.get("cache_maps_more_batches"),
      "warm_cache_hit": warm.get("cache_hit", warm.get("cache_unchanged")),
      "warm_cache_unchanged": warm.get("cache_unchanged")}


def fmt(v, digits: int = 1) -> str:
  if v is None:
    return "-"
  if isinstance(v, bool):
    return "yes" if v else "NO"
  if isinstance(v, int):
    return f"{v:,}"
  return f"{v:,.{digits}f}" if abs(v) < 100 else f"{v:,.0f}"


HEAD = ("N", "system", "W", "cold s", "chats/s", "tok/s", "tok/s/proc", "CPU s",
        "peak RSS MB", "peak PSS MB", "cache MB", "warm import s", "warm 1st batch s",
        "warm data s", "warm peak RSS MB", "data RSS MB", "fds / cache maps",
        f"after {MORE_BATCHES} more", "warm hit")
SECONDS = {"cold_s", "cold_cpu_s", "warm_import_s", "warm_first_batch_s", "warm_data_s"}
KEYS = ("cold_s", "chats_per_s", "tokens_per_s", "tokens_per_s_per_process", "cold_cpu_s",
        "cold_peak_rss_mb", "cold_peak_pss_mb", "cache_mb", "warm_import_s",
        "warm_first_batch_s", "warm_data_s", "warm_peak_rss_mb", "warm_data_rss_mb",
        "handles", "handles_more", "warm_cache_hit")


def _handles_cell(row: dict, key: str) -> str:
  more = "_more" if key.endswith("_more") else ""
  fds, maps = row.get(f"warm_fds{more}"), row.get(f"warm_cache_maps{more}")
  return "-" if fds is None else f"{fds} / {maps}"


def comparisons(rows: list[dict]) -> dict:
  """Cold speedups over W=1 per (N, system), and the peer's seconds over ours per (N, W)."""
  by = {(r["chats"], r["system"], r["workers"]): r for r in rows}
  speedup, peer_over_ours = {}, {}
  for (n, system, w), r in by.items():
    one = by.get((n, system, 1))
    if one and w != 1:
      shards = f" ({r['shards_built']} shards built)" if r.get("shards_built") else ""
      speedup[f"{system} N={n} W={w}{shards}"] = one["cold_s"] / r["cold_s"]
    if system == "ours" and (n, "datasets.map", w) in by:
      p = by[(n, "datasets.map", w)]
      peer_over_ours[f"N={n} W={w}"] = {
          "cold_s": p["cold_s"] / r["cold_s"],
          "warm_first_batch_s": p["warm_first_batch_s"] / r["warm_first_batch_s"],
          "tokens_equal": p["tokens"] == r["tokens"]}
  return {"speedup_over_w1": speedup, "peer_over_ours": peer_over_ours}


def print_table(result: dict) -> None:
  print(f"\nmodel {result['model_dir']}; cold: a fresh cache, process start to exit; warm: "
        "a new process on that cache, seconds from its start"
        + (", the page cache dropped before it" if result.get("drop_page_cache") else "")
        + "; warm data s: from the tokenizer loaded to the first batch; fds / cache maps: "
        "the warm process's open descriptors and mapped cache files at its first batch "
        f"(ours: and after {MORE_BATCHES} more); RSS/PSS: the process tree's sum, peak")
  for n, facts in result["chats"].items():
    tokens = next((r["tokens"] for r in result["rows"] if r["chats"] == int(n) and r["tokens"]),
                  None)
    mean = f"{tokens / int(n):.0f} tokens a chat" if tokens else "tokens not counted"
    print(f"N={n}: {facts['path']} ({facts['bytes'] / 2**20:.0f} MB, {mean})")
  print("| " + " | ".join(HEAD) + " |")
  print("|" + "---|" * len(HEAD))
  for r in result["rows"]:
    cells = [fmt(r["chats"]), r["system"], str(r["workers"])]
    cells += [_handles_cell(r, k) if k.startswith("handles") else
              fmt(r[k], 2 if k in SECONDS else 1) for k in KEYS]
    print("| " + " | ".join(cells) + " |")
  for key, value in result["comparisons"]["speedup_over_w1"].items():
    print(f"cold speedup over W=1, {key}: {value:.2f}x")
  for key, value in result["comparisons"]["peer_over_ours"].items():
    print(f"datasets.map / ours, {key}: cold s {value['cold_s']:.2f}x, warm s to the first "
          f"batch {value['warm_first_batch_s']:.2f}x; tokens equal: "
          f"{fmt(value['tokens_equal'])}")
  print(f"load average (1 min) {result['load_average_start'][0]:.1f} at the start, "
        f"{result['load_average_end'][0]:.1f} at the end, on {result['cpu_count']} CPUs")
  print("ours also finds the assistant spans and writes loss masks; the peer's plain "
        "tokenize has no targets (TRL masks assistants only for templates with "
        "{% generation %} tags, which Qwen2.5's lacks).", flush=True)


def print_stages(result: dict) -> None:
  n, fixed = result["chats"], result["fixed"]
  print(f"one core, the first {n:,} chats ({result['tokens'] / n:.0f} tokens a chat), "
        "each step the best of three")
  print("| step | s | ms a chat |")
  print("|---|---|---|")
  for name, secs in result["steps_s"].items():
    print(f"| {name} | {secs:.2f} | {1000 * secs / n:.3f} |")
  print(f"fixed, once a process: imports {fixed['imports_s']:.2f} s, tokenizer "
        f"{fixed['tokenizer_s']:.2f} s, its fingerprint {fixed['fingerprint_s']:.2f} s; "
        f"once a file: its content hash {fixed['content_hash_s']:.2f} s "
        f"({fixed['file_mb']:.0f} MB)", flush=True)
