"""The server's default batch (`mars_jax.serve.sizing`): rows from the free memory at
--max-len, capped at 256, and an error that says what to change when not one fits."""

import dataclasses

import pytest

from mars_jax.models import qwen2
from mars_jax.models.qwen2 import Runtime
from mars_jax.serve import sizing

GiB = 2 ** 30
QWEN_05B = qwen2.preset("qwen2.5-0.5b")


@dataclasses.dataclass
class Device:
  """What `sizing.budget` reads of a device: its allocator's limit and use."""
  limit: int
  used: int
  device_kind: str = "NVIDIA H100 80GB HBM3"

  def memory_stats(self):
    return {"bytes_limit": self.limit, "bytes_in_use": self.used}


def test_a_rows_bytes_are_its_kv_cache_at_max_len_and_the_work_of_a_step():
  runtime = Runtime(param_dtype="bfloat16", dtype="bfloat16")
  got = sizing.row_bytes(QWEN_05B, runtime, max_len=4100, window=5, prefill_chunk=64)
  kv = 2 * 24 * 2 * 4100 * 64 * 2      # K and V, 24 layers, 2 KV heads of 64, bf16
  assert kv < got < kv + 30 * 2 ** 20  # plus buffers, logits at 9 slots, a prefill step


def test_the_default_batch_fills_the_budget_up_to_256_rows():
  runtime = Runtime(param_dtype="bfloat16", dtype="bfloat16")
  per_row = sizing.row_bytes(QWEN_05B, runtime, max_len=4100, window=5, prefill_chunk=64)
  kwargs = dict(max_len=4100, window=5, prefill_chunk=64, utilization=0.9)
  rows, why = sizing.default_rows(QWEN_05B, runtime, devices=[Device(75 * GiB, GiB)],
                                  **kwargs)
  assert rows == 256 and "capped at 256" in why and "H100" in why
  rows, why = sizing.default_rows(QWEN_05B, runtime, devices=[Device(8 * GiB, GiB)],
                                  **kwargs)
  assert rows == int(0.9 * 8 * GiB - GiB) // per_row < 256 and "capped" not in why
  with pytest.raises(ValueError, match="lower --max-len or raise --memory-utilization"):
    sizing.default_rows(QWEN_05B, runtime, devices=[Device(GiB, GiB)], **kwargs)


def test_on_the_cpu_backend_the_budget_is_the_hosts_available_memory():
  room, where = sizing.budget(0.5)
  assert 0 < room and "available on the host" in where
