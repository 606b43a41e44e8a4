"""`python -m mars_jax.bench {step,sample,decode,device,serve,speculative,data} ...`: benchmarks
vs a peer.

  step    MARS train step vs AR-SFT step at equal (b, L); chunked vs naive loss memory
  sample  MARS decoding vs our jitted AR loop vs transformers' generate
  decode  where a decoding step's time goes: measured step vs the memory roofline,
          XLA's cost analysis and the layout copies left in the compiled step
  device  the accelerator check's figures (launch/device_check.sh): bf16 step times and
          MFU, decoding vs AR and vs the HBM roofline; --smoke for tiny shapes on CPU
  speculative  two-model decoding (AR or MARS drafter x AR or MARS target) vs the target
          alone, both trained on the embedded task
  serve   the HTTP server (python -m mars_jax.serve) under N closed-loop users of the
          openai client: window auto vs W=1 vs the peers (--peer: transformers serve
          --continuous-batching, vllm serve from the venv of launch/vllm_venv.sh);
          what vllm bench serve reports, rows per forward, compiles after ready
  data    building and reading the training data: our tokenized cache (python -m
          mars_jax.data.prepare --workers W, then a training start's first batch) vs
          datasets' .map as TRL's SFTTrainer runs it, cold and warm, on N generated chats
"""

import importlib
import sys

_COMMANDS = {"step": "mars_jax.benchmarks.step", "sample": "mars_jax.benchmarks.sample",
             "device": "mars_jax.benchmarks.device", "decode": "mars_jax.benchmarks.decode_cost",
             "serve": "mars_jax.benchmarks.serve_load",
             "speculative": "mars_jax.benchmarks.speculative",
             "data": "mars_jax.benchmarks.data"}


def main(argv=None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  if not argv or argv[0] not in _COMMANDS:
    print(__doc__.strip())
    sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
  importlib.import_module(_COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
  main()
