"""The accelerators maxtrain knows: one row per chip, read by everything that needs a chip's
figures: the MFU denominator (training/metrics.py), the memory fit (analysis/memory.py) and
the step-time model (analysis/step_time.py).

Each row holds the vendor's published figures, per chip (per GPU): dense peak FLOP/s per
operand dtype, HBM capacity and bandwidth, the chip-to-chip interconnect (ICI on TPUs, NVLink
on GPUs) and the data-center network. Sources:
  TPUs: Google Cloud TPU documentation, "System architecture" of each generation
    (docs.cloud.google.com/tpu/docs/{v4,v5e,v5p,v6e,tpu7x}); v4's ICI links from "TPU v4: An
    Optically Reconfigurable Supercomputer" (Jouppi et al., ISCA 2023: six links of 50 GB/s
    per direction). A float32 matmul on a TPU runs as one bfloat16 pass at XLA's default
    precision (jax's `default_matmul_precision` documentation), so its peak is bfloat16's.
  GPUs: NVIDIA's datasheets (H100 SXM5, H200 SXM, DGX B200): dense figures, i.e. half the
    "with sparsity" ones; float32 is TF32 on the tensor cores, which XLA uses for float32 dots
    on these GPUs. The network is one 400 Gb/s NIC per GPU (ConnectX-7, as on DGX H100).
  Host link (what a program offloads to the host's memory crosses it): a TPU's PCIe, 1.5e10
    B/s per chip, the figure of "How to Scale Your Model" (jax-ml.github.io/scaling-book, part 2:
    TPUs), for every generation (no generation's is documented apart); a GPU's PCIe, Gen5 x16
    (NVIDIA's datasheets: 128 GB/s both ways), 64 GB/s per direction, an A100's Gen4 half that.
"""

from __future__ import annotations

from dataclasses import dataclass

TERA = 1e12
GIGA = 1e9


@dataclass(frozen=True)
class Chip:
    """One accelerator's published figures (per chip; a GPU is one chip)."""

    name: str
    kinds: tuple[str, ...]  # lower-case substrings of jax's device_kind that name this chip
    platform: str  # "tpu" or "gpu"
    peak_flops: dict[str, float]  # dense matmul FLOP/s by operand dtype: bf16, f32, int8, fp8
    hbm_gib: float  # memory capacity (GiB, as the vendor states it)
    hbm_bytes_per_s: float
    # Chip-to-chip links: the bandwidth of one port in one direction, and how many ports.
    # A TPU's ports pair up per torus dimension (one to each neighbour); a GPU's NVLink
    # ports all reach the switch, so they count as one.
    link_bytes_per_s: float
    ports: int
    torus_dims: int  # 2 (v5e, v6e), 3 (v4, v5p, TPU7x); 0 for a switch (NVLink)
    dcn_bytes_per_s: float | None  # per chip, one direction, between slices (hosts)
    host_bytes_per_s: float  # per chip, one direction, to and from the host's memory

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s of a matmul whose operands are `dtype` (bf16 for a dtype the chip
        has no faster unit for)."""
        return self.peak_flops.get(_DTYPE_CLASS.get(dtype, "bf16"), self.peak_flops["bf16"])

    def ring_bytes_per_s(self, dims: int) -> float:
        """What one chip sends per second in a collective over a group of chips spanning
        `dims` dimensions of its interconnect: on a torus, both neighbours' links of each
        dimension (a bidirectional ring per dimension); on a switch, all its links."""
        if self.torus_dims == 0:
            return self.link_bytes_per_s * self.ports
        return 2 * self.link_bytes_per_s * max(1, min(dims, self.torus_dims))


_DTYPE_CLASS = {
    "bf16": "bf16", "f16": "bf16", "f32": "f32", "s8": "int8", "u8": "int8", "s4": "int8",
    "f8e4m3fn": "fp8", "f8e5m2": "fp8", "f8e4m3": "fp8", "f8e4m3fnuz": "fp8", "f8e5m2fnuz": "fp8",
}  # fmt: skip


def _tpu(name, kinds, bf16, int8, fp8, hbm_gib, hbm_gbps, ici_gbps, ports, dims, dcn_gbit):
    """A TPU row from its documented figures: ICI as the documented bidirectional bandwidth
    per chip over its ports, the DCN in Gb/s per chip."""
    flops = {"bf16": bf16 * TERA, "f32": bf16 * TERA, "int8": int8 * TERA, "fp8": fp8 * TERA}
    link = ici_gbps * GIGA / ports / 2
    dcn = None if dcn_gbit is None else dcn_gbit * GIGA / 8
    pcie = 15 * GIGA
    return Chip(name, kinds, "tpu", flops, hbm_gib, hbm_gbps * GIGA, link, ports, dims, dcn, pcie)


def _gpu(name, kinds, bf16, tf32, int8, fp8, hbm_gib, hbm_tbps, nvlink_gbps, pcie_gbps=64):
    """A GPU row: NVLink as the datasheet's total bidirectional bandwidth, one 400 Gb/s NIC, the
    PCIe link per direction (Gen5 x16; an A100's is Gen4, half that)."""
    flops = {"bf16": bf16 * TERA, "f32": tf32 * TERA, "int8": int8 * TERA, "fp8": fp8 * TERA}
    nvlink = nvlink_gbps * GIGA / 2
    pcie = pcie_gbps * GIGA
    return Chip(name, kinds, "gpu", flops, hbm_gib, hbm_tbps * TERA, nvlink, 1, 0, 50 * GIGA, pcie)


# First match wins: more specific names come before their prefixes ("tpu v5 lite", v5e's
# device_kind, before "tpu v5", v5p's).
CHIPS: tuple[Chip, ...] = (
    # name, device_kind, TFLOP/s bf16, int8, fp8, HBM GiB and GB/s, ICI GB/s (bidirectional),
    # ICI ports, torus dimensions, DCN Gb/s
    _tpu("TPU v6e", ("tpu v6 lite", "tpu v6e"), 918, 1836, 918, 32, 1638, 800, 4, 2, 100),
    _tpu("TPU v5e", ("tpu v5 lite", "tpu v5e"), 197, 393, 197, 16, 819, 400, 4, 2, 25),
    _tpu("TPU v5p", ("tpu v5p", "tpu v5"), 459, 918, 459, 95, 2765, 1200, 6, 3, 50),
    _tpu("TPU v4", ("tpu v4",), 275, 275, 275, 32, 1200, 600, 6, 3, None),
    _tpu("TPU7x", ("tpu7x", "tpu v7"), 2307, 4614, 4614, 192, 7380, 1200, 6, 3, None),
    # name, device_kind, TFLOP/s bf16, tf32, int8, fp8, HBM GiB and TB/s, NVLink GB/s
    _gpu("B200", ("b200",), 2250, 1125, 4500, 4500, 180, 8.0, 1800),
    _gpu("H200", ("h200",), 989, 494.5, 1979, 1979, 141, 4.8, 900),
    _gpu("H100", ("h100",), 989, 494.5, 1979, 1979, 80, 3.35, 900),
    _gpu("A100 40GB", ("a100-sxm4-40gb", "a100-pcie-40gb"), 312, 156, 624, 312, 40, 1.555, 600, 32),
    _gpu("A100", ("a100",), 312, 156, 624, 312, 80, 2.039, 600, 32),
)


def chip(device_kind: str) -> Chip | None:
    """The row of a device kind as jax names it ("TPU v5 lite", "NVIDIA H100 80GB HBM3"), or
    None for a device maxtrain has no figures for (a CPU)."""
    kind = device_kind.lower()
    return next((c for c in CHIPS if any(needle in kind for needle in c.kinds)), None)


def platform(device_kind: str) -> str:
    """The platform ("tpu", "gpu", "cpu") of a device kind as jax names it: what the kernels
    and the compute dtype are chosen for (training/run_model.py for_platform)."""
    if device_kind.lower().startswith("tpu"):
        return "tpu"
    found = chip(device_kind)
    return found.platform if found is not None else "cpu"
