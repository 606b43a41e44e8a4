"""Accelerators the project plans for, and compile-only devices of them on any host.

  topology = parse_topology("v5p-8")        # or "v5p:2x2x1", "h100-8", "h200-16"
  devices  = compile_devices(topology)       # needs libtpu / the jax CUDA pjrt plugin

Each `Chip` holds the published figures `mars_jax.plan` reads: memory per chip
(HBM), its bandwidth, and the dense bfloat16 matmul peak. A TPU slice is named as
Google Cloud's accelerator types name it (`v5p-8`: the number counts TensorCores,
two per v5p chip, so 4 chips; `v5e-16` and `v6e-8` count chips) or as jax does
(`v5p:2x2x1`, chips per axis). A GPU node is `<gpu>-<count>` (`h100-8`, `h200-8`,
`a100-80-8`, `b200-8`; more than 8 is several nodes of 8), compiled from an XLA
GPU target config (a `GpuTargetConfigProto` text) that `gpu_target_config` writes
from the same published figures.

No accelerator is needed: `jax.experimental.topologies.get_topology_desc` makes
devices that only compile (`jit(...).lower(...).compile()` runs the real TPU or GPU
compiler, its memory analysis included) under `JAX_PLATFORMS=cpu`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from typing import Any

import jax

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator's published figures.

  hbm_bytes: device memory; hbm_bandwidth: bytes/s; bf16_flops: dense bfloat16
  matmul peak, FLOP/s. GPU-only fields feed the XLA target config: sm_count,
  compute_capability (major, minor), l2_bytes, clock_ghz, smem_per_sm (bytes). A TPU's
  name is its generation as jax's topology names spell it ("v5p").
  """
  name: str
  platform: str           # "tpu" | "cuda"
  hbm_bytes: int
  hbm_bandwidth: float
  bf16_flops: float
  cores_per_chip: int = 1  # TPU: TensorCores a Cloud accelerator type counts per chip
  device_kind: str = ""   # what `jax.Device.device_kind` reports for it
  sm_count: int = 0
  compute_capability: tuple[int, int] = (0, 0)
  l2_bytes: int = 0
  clock_ghz: float = 0.0
  smem_per_sm: int = 0


# Published figures: Cloud TPU system architecture pages (v5e, v5p, v6e: memory in GiB)
# and NVIDIA's datasheets (A100 SXM, H100 SXM, H200 SXM, HGX B200), whose memory is read
# as decimal GB (H200: 141e9 bytes, 131.3 GiB), the smaller reading.
_A100 = Chip("a100-80", "cuda", 80 * 10**9, 2039e9, 312e12, device_kind="NVIDIA A100-SXM4-80GB",
             sm_count=108, compute_capability=(8, 0), l2_bytes=40 << 20, clock_ghz=1.41,
             smem_per_sm=164 << 10)
_H100 = Chip("h100", "cuda", 80 * 10**9, 3350e9, 989e12, device_kind="NVIDIA H100 80GB HBM3",
             sm_count=132, compute_capability=(9, 0), l2_bytes=50 << 20, clock_ghz=1.98,
             smem_per_sm=228 << 10)
CHIPS: dict[str, Chip] = {c.name: c for c in (
    Chip("v5e", "tpu", 16 * GIB, 819e9, 197e12, device_kind="TPU v5 lite"),
    Chip("v5p", "tpu", 95 * GIB, 2765e9, 459e12, cores_per_chip=2,
         device_kind="TPU v5"),
    Chip("v6e", "tpu", 32 * GIB, 1640e9, 918e12, device_kind="TPU v6 lite"),
    dataclasses.replace(_A100, name="a100-40", hbm_bytes=40 * 10**9, hbm_bandwidth=1555e9,
                        device_kind="NVIDIA A100-SXM4-40GB"),
    _A100,
    _H100,
    dataclasses.replace(_H100, name="h200", hbm_bytes=141 * 10**9, hbm_bandwidth=4800e9,
                        device_kind="NVIDIA H200"),
    Chip("b200", "cuda", 180 * 10**9, 8000e9, 2250e12, device_kind="NVIDIA B200",
         sm_count=148, compute_capability=(10, 0), l2_bytes=126 << 20, clock_ghz=1.965,
         smem_per_sm=228 << 10),
)}
GPUS_PER_NODE = 8


@dataclasses.dataclass(frozen=True)
class Topology:
  """A slice or node: `chip`, its chip count, and the name jax's topology call takes
  ("v5p:2x2x1"; for GPUs "<nodes>x1x<gpus per node>", as the CUDA plugin reads it)."""
  name: str
  chip: Chip
  chips: int
  jax_topology: str


def _tpu_shape(chips: int, dims: int) -> str:
  """The chip grid of a slice of `chips` chips, as Cloud TPU lays them out: a 3-D torus
  (v5p) from one host's 2x2x1, a 2-D one (v5e, v6e) from 1x1, doubling the smallest
  axis (the last of equals) -> 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4; 1x1, 1x2, 2x2, 2x4."""
  if chips < 1 or chips & (chips - 1):
    raise ValueError(f"{chips} chips: a TPU slice has a power-of-two chip count.")
  sizes = [2, 2, 1] if dims == 3 else [1, 1]
  if math.prod(sizes) > chips:
    raise ValueError(f"{chips} chip(s): the smallest slice of this generation has "
                     f"{math.prod(sizes)} chips ({'x'.join(map(str, sizes))}).")
  while math.prod(sizes) < chips:
    i = max(j for j, s in enumerate(sizes) if s == min(sizes))
    sizes[i] *= 2
  return "x".join(map(str, sizes))


def parse_topology(name: str) -> Topology:
  """"v5p-8" | "v5p:2x2x1" | "v5e-16" | "v6e-8" | "h100-8" | "a100-80-8" ... -> Topology;
  ValueError naming the known forms for anything else."""
  known = (f"TPU: {', '.join(c.name + '-N' for c in CHIPS.values() if c.platform == 'tpu')}"
           f" (Cloud accelerator types) or <gen>:AxBxC (jax's names, e.g. v5p:2x2x1); GPU: "
           f"{', '.join(c.name + '-N' for c in CHIPS.values() if c.platform == 'cuda')}")
  m = re.fullmatch(r"(v5e|v5p|v6e):(\d+(?:x\d+)+)", name)
  if m:
    chip = CHIPS[m.group(1)]
    chips = math.prod(int(s) for s in m.group(2).split("x"))
    return Topology(name, chip, chips, name)
  m = re.fullmatch(r"(.+)-(\d+)", name)
  if not m or m.group(1) not in CHIPS:
    raise ValueError(f"unknown topology {name!r}; known: {known}.")
  chip, count = CHIPS[m.group(1)], int(m.group(2))
  if chip.platform == "cuda":
    if count < 1 or (count > GPUS_PER_NODE and count % GPUS_PER_NODE):
      raise ValueError(f"topology {name!r}: a GPU count up to {GPUS_PER_NODE} (one node) or "
                       f"a multiple of {GPUS_PER_NODE} (whole nodes).")
    nodes, per_node = max(count // GPUS_PER_NODE, 1), min(count, GPUS_PER_NODE)
    return Topology(name, chip, count, f"{nodes}x1x{per_node}")
  if count % chip.cores_per_chip:
    raise ValueError(f"topology {name!r}: {chip.name} counts {chip.cores_per_chip} "
                     "TensorCores per chip; the number must be a multiple of it.")
  try:
    shape = _tpu_shape(count // chip.cores_per_chip, 3 if chip.name == "v5p" else 2)
  except ValueError as e:
    raise ValueError(f"topology {name!r}: {e}") from None
  chips = count // chip.cores_per_chip
  return Topology(name, chip, chips, f"{chip.name}:{shape}")


def gpu_target_config(chip: Chip) -> str:
  """XLA's `GpuTargetConfigProto` text for `chip`, from its published figures."""
  major, minor = chip.compute_capability
  return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {chip.smem_per_sm}
  shared_memory_per_block_optin: {chip.smem_per_sm - (1 << 10)}
  threads_per_core_limit: 2048
  core_count: {chip.sm_count}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(chip.hbm_bandwidth)}
  l2_cache_size: {chip.l2_bytes}
  clock_rate_ghz: {chip.clock_ghz}
  device_memory_size: {chip.hbm_bytes}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
device_description_str: "{chip.device_kind}"
"""


def missing_compiler(topology: Topology) -> str | None:
  """None when this host can compile for `topology`, else what to install (one line)."""
  if topology.chip.platform == "tpu":
    if importlib.util.find_spec("libtpu") is None:
      return (f"compiling for {topology.name} needs libtpu (no TPU needed): "
              f"pip install 'jax[tpu]=={jax.__version__}'")
    return None
  if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
    return (f"compiling for {topology.name} needs the jax CUDA plugin (no GPU needed): "
            f"pip install jax-cuda12-pjrt=={jax.__version__} jax-cuda12-plugin=={jax.__version__}")
  return None


def compile_devices(topology: Topology) -> list[Any]:
  """Compile-only devices of `topology`, in jax's order; ValueError with the install
  line when the compiler is missing."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  missing = missing_compiler(topology)
  if missing:
    raise ValueError(missing)
  if topology.chip.platform == "tpu":
    # libtpu takes a host-wide lock when it loads, which only a TPU in use needs: let
    # several compiling processes (two plans, a test run in parallel) load it at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    desc = topologies.get_topology_desc(topology_name=topology.jax_topology, platform="tpu")
  else:
    desc = topologies.get_topology_desc(
        "mars_jax", "cuda", target_config=gpu_target_config(topology.chip),
        topology=topology.jax_topology)
  devices = list(desc.devices)
  if len(devices) != topology.chips:
    raise ValueError(f"topology {topology.name}: jax made {len(devices)} devices for "
                     f"{topology.jax_topology}, expected {topology.chips} chips.")
  return devices
