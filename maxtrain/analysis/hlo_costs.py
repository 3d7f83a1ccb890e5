"""The work of each instruction of a compiled program: its matmul FLOPs (by operand dtype) and
the bytes it moves to and from the chip's memory. step_time.py times the program from them.

Read from the program's text (`compiled.as_text()`, or the `after_optimizations` dump of a
compiler run), the same way for every backend:
  FLOPs       a dot's 2 x result x contracted depth; a convolution (how the TPU compiler writes
              its matmuls) 2 x output features x input features x the window positions that
              meet real input (its padding skipped: the TPU compiler writes a batched matmul as
              a padded convolution whose window meets one input position per output); a
              fusion's, the sum of what it fuses. Element-wise work counts no FLOPs: the
              matrix units do not run it.
  kernels     a hand-written (Pallas/Mosaic) kernel is opaque to the compiler: its call
              carries no cost estimate (splash attention and tokamax set none) and XLA's cost
              analysis counts nothing inside it, so its FLOPs are counted from its operand
              shapes (and, for tokamax's GPU kernels, the arguments it records in the call's
              metadata). Attention (splash on TPU, tokamax's flash attention on GPU): 2 x heads
              x queries x keys x head dim per matmul, 2 matmuls forward (QK^T, PV), 3 for dQ,
              4 for dK and dV, 5 for a kernel producing all three, times the share of query x
              key blocks the mask keeps (a square block table is taken as causal, n (n + 1) / 2
              of its n^2 blocks, a band as the blocks it visits; tokamax records its mask).
              Grouped matmuls (tokamax's and megablox's gmm/tgmm, tokamax's GPU ragged dot): 2
              x rows x the expert matrix's dimensions. Any other kernel counts nothing and is
              named in `Module.unknown_kernels`, so that an undercount shows.
  bytes       each operand and result as laid out (tiles padded), except what sits in the TPU
              core's own memory (memory space 1, VMEM: no HBM traffic) or is a scalar flag;
              a fusion reads only the slices it takes of an operand that it slices, an
              asynchronous slice (slice-start) only its slice, and an in-place update
              (dynamic-update-slice) moves the update, not its whole buffer;
              bytes to and from the host's memory (space 5) apart.
"""

from __future__ import annotations

import functools
import json
import math
import re
from typing import NamedTuple

from maxtrain.analysis.program import DTYPE_BYTES, INSTRUCTION, KERNEL_TARGETS, parse_computations

_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](?:\{([^}]*)\})?")
_TILE = re.compile(r"T\(([\d,]+)\)")
_SPACE = re.compile(r"S\((\d+)\)")
VMEM, HOST = 1, 5  # the TPU's memory spaces: on-core vector memory, the host's memory
_FREE_SPACES = frozenset({VMEM, 2, 3, 4})  # VMEM, scalar memory, sync flags
COLLECTIVE_OPCODES = frozenset({
    "all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
    "collective-permute",
})  # fmt: skip


class Array(NamedTuple):
    """One array of an HLO shape: its element type, dimensions and where it lives."""

    dtype: str
    dims: tuple[int, ...]
    space: int  # memory space: 0 HBM, 1 VMEM, 5 host (TPU); always 0 elsewhere
    nbytes: int  # as laid out: a TPU layout's tiles padded


def arrays(shape: str) -> list[Array]:
    """The arrays of an HLO shape text (one array, or a tuple of them)."""
    found = []
    for dtype, dims_text, layout in _ARRAY.findall(shape):
        if dtype not in DTYPE_BYTES:
            continue
        dims = tuple(int(d) for d in dims_text.split(",") if d)
        space = _SPACE.search(layout)
        found.append(
            Array(dtype, dims, int(space[1]) if space else 0, _laid_out_bytes(dtype, dims, layout))
        )
    return found


def _laid_out_bytes(dtype: str, dims: tuple[int, ...], layout: str) -> int:
    """Bytes of an array as its layout stores it: the minor dimensions padded to the layout's
    first tile (a TPU's T(8,128): the minor-most to 128, the next to 8)."""
    tile = _TILE.search(layout)
    order = layout.split(":")[0]
    padded = list(dims)
    if tile and order and dims:
        minor_to_major = [int(d) for d in order.split(",") if d]
        sizes = [int(t) for t in tile[1].split(",")]
        for dim, size in zip(reversed(minor_to_major[: len(sizes)]), sizes, strict=False):
            padded[dim] = -(-padded[dim] // size) * size
    return math.prod(padded) * DTYPE_BYTES[dtype]


class Instruction(NamedTuple):
    """One instruction of a compiled program."""

    name: str
    shape: str  # its result shape, as written
    opcode: str
    operands: tuple[str, ...]  # names, `name#i` for element i of a tuple-shaped operand
    attributes: str  # the rest of its line

    @property
    def results(self) -> list[Array]:
        return arrays(self.shape)


_OPERAND = re.compile(r"%([\w.\-]+(?:#\d+)?)")


class Module:
    """A compiled program's computations, each a list of instructions in schedule order."""

    def __init__(self, hlo_text: str):
        lines, self.entry = parse_computations(hlo_text)
        self.computations: dict[str, list[Instruction]] = {}
        self.defined: dict[str, Instruction] = {}
        for computation, body in lines.items():
            self.computations[computation] = []
            for line in body:
                if match := INSTRUCTION.match(line):
                    name, shape, opcode, rest = match.groups()
                    operands = tuple(_OPERAND.findall(rest.split(")", 1)[0]))
                    ins = Instruction(name, shape, opcode, operands, rest)
                    self.computations[computation].append(ins)
                    self.defined[name] = ins
        self.text_lines = lines
        self.unknown_kernels: set[str] = set()

    def operand_arrays(self, operand: str) -> list[Array]:
        """The arrays an operand reference names (`x#1`: element 1 of x's tuple)."""
        name, _, index = operand.partition("#")
        found = arrays(self.defined[name].shape) if name in self.defined else []
        if index and found:
            return [found[int(index)]] if int(index) < len(found) else []
        return found

    def callee(self, ins: Instruction) -> str | None:
        """The computation a fusion, call or async instruction runs (None for others)."""
        match = re.search(r"\b(?:calls|to_apply)=%([\w.\-]+)", ins.attributes)
        return match[1] if match else None

    # ---- FLOPs ---------------------------------------------------------------------------

    @functools.cache  # noqa: B019 (a Module lives as long as one prediction)
    def flops(self, name: str) -> tuple[float, str]:
        """(matmul FLOPs, operand dtype of the largest) of one run of an instruction."""
        ins = self.defined[name]
        if ins.opcode == "dot":
            return _dot_flops(self, ins)
        if ins.opcode == "convolution":
            return _convolution_flops(self, ins)
        if ins.opcode == "custom-call":
            found = _kernel_flops(ins, self)
            if found is None and KERNEL_TARGETS.search(ins.attributes):
                self.unknown_kernels.add(kernel_name(ins))
            return found or (0.0, "bf16")
        if ins.opcode == "fusion" and (callee := self.callee(ins)):
            parts = [self.flops(i.name) for i in self.computations.get(callee, [])]
            total = sum(f for f, _ in parts)
            dtype = max(parts, key=lambda p: p[0])[1] if parts else "bf16"
            return total, dtype
        return 0.0, "bf16"

    # ---- bytes ---------------------------------------------------------------------------

    def hbm_bytes(self, ins: Instruction) -> tuple[int, int]:
        """(bytes to and from HBM, bytes to and from the host's memory) of one run of an
        instruction: what it reads of its operands and writes of its results."""
        reads = self._read_arrays(ins)
        writes = self._written_arrays(ins)
        hbm = sum(a.nbytes for a in reads + writes if a.space not in _FREE_SPACES | {HOST})
        host = sum(a.nbytes for a in reads + writes if a.space == HOST)
        return hbm, host

    def _read_arrays(self, ins: Instruction) -> list[Array]:
        if ins.opcode in ("dynamic-slice", "slice", "gather"):
            return [_as_space(a, self.operand_arrays(ins.operands[0])) for a in ins.results]
        if ins.opcode == "slice-start":
            return [_as_space(_async_slice(ins), self.operand_arrays(ins.operands[0]))]
        if ins.opcode == "dynamic-update-slice":
            return self.operand_arrays(ins.operands[1])
        callee = self.callee(ins) if ins.opcode == "fusion" else None
        if callee is None:
            return [a for operand in ins.operands for a in self.operand_arrays(operand)]
        params = _parameters(self.computations[callee])
        read = []
        for index, operand in enumerate(ins.operands):
            sliced = _slices_taken(self.computations[callee], params.get(index))
            read += sliced if sliced is not None else self.operand_arrays(operand)
        return read

    def _written_arrays(self, ins: Instruction) -> list[Array]:
        if ins.opcode == "slice-start":
            return [_async_slice(ins)]
        body = self.computations.get(self.callee(ins), []) if ins.opcode == "fusion" else []
        root = body[-1] if body else ins
        if root.opcode == "dynamic-update-slice":
            return [_as_space(a, ins.results) for a in self.operand_arrays(root.operands[1])]
        if root.opcode != "tuple" or not body:
            return ins.results
        # a multi-output fusion writes what it computes, not what it passes through (a
        # parameter) or what a collective inside it fills (the TPU compiler's asynchronous
        # collective fusions hand the collective's buffers on)
        made = {i.name: i for i in body}
        passed = {"parameter", *COLLECTIVE_OPCODES}
        return [
            array
            for element, array in zip(root.operands, ins.results, strict=False)
            if made.get(element.partition("#")[0], root).opcode not in passed
        ]


def _async_slice(ins: Instruction) -> Array:
    """The slice an asynchronous slice-start takes (the TPU compiler's, often into VMEM): its
    result is ((its operands), the slice, a sync flag); the operands are passed through, not
    read whole or written."""
    return ins.results[len(ins.operands)]


def _as_space(array: Array, buffer: list[Array]) -> Array:
    """A slice of a buffer lives where the buffer does."""
    return array._replace(space=buffer[0].space) if buffer else array


def _parameters(body: list[Instruction]) -> dict[int, Instruction]:
    """A fused computation's parameters by index."""
    found = {}
    for ins in body:
        if ins.opcode == "parameter" and (match := re.match(r"(\d+)\)", ins.attributes)):
            found[int(match[1])] = ins
    return found


def _slices_taken(body: list[Instruction], param: Instruction | None) -> list[Array] | None:
    """What a fusion reads of a parameter it only slices (or updates in place): the slices'
    arrays. None when it reads the parameter whole."""
    if param is None:
        return None
    users = [ins for ins in body if param.name in {o.partition("#")[0] for o in ins.operands}]
    taken: list[Array] = []
    for user in users:
        if user.opcode in ("dynamic-slice", "slice") and user.operands[0] == param.name:
            taken += user.results
        elif user.opcode == "dynamic-update-slice" and user.operands[0] == param.name:
            continue  # the buffer updated in place: not read
        elif user.opcode in COLLECTIVE_OPCODES or user.opcode in ("tuple", "custom-call"):
            continue  # a collective's buffer, or handed on: the fusion's compute reads none
        else:
            return None
    return taken if users else []


def _dims(module: Module, operand: str) -> tuple[int, ...]:
    found = module.operand_arrays(operand)
    return found[0].dims if found else ()


def _dot_flops(module: Module, ins: Instruction) -> tuple[float, str]:
    """2 x the result's elements x the contracted depth."""
    lhs = _dims(module, ins.operands[0])
    contracted = re.search(r"\blhs_contracting_dims=\{([\d,]*)\}", ins.attributes)
    depth = math.prod(lhs[int(i)] for i in contracted[1].split(",") if i) if contracted else 1
    result = ins.results
    dtype = module.operand_arrays(ins.operands[0])
    return 2.0 * math.prod(result[0].dims) * depth, dtype[0].dtype if dtype else "bf16"


_DIM_LABELS = re.compile(r"\bdim_labels=(\w+)_(\w+)->(\w+)")
_WINDOW = re.compile(r"\bwindow=\{([^}]*)\}")


def _convolution_flops(module: Module, ins: Instruction) -> tuple[float, str]:
    """2 x batch x output features x input features x, per spatial dimension, the (output
    position, window position) pairs that meet real input: the TPU compiler writes batched
    matmuls as convolutions whose padded windows meet one input position each."""
    labels = _DIM_LABELS.search(ins.attributes)
    lhs_dims, rhs_dims = _dims(module, ins.operands[0]), _dims(module, ins.operands[1])
    out_dims = ins.results[0].dims
    lhs_labels, rhs_labels, out_labels = labels.groups()
    window = _window(ins.attributes)
    pairs = 1
    for d in range(sum(ch.isdigit() for ch in rhs_labels)):
        size, low, high, stride = window[d] if d < len(window) else (1, 0, 0, 1)
        label = str(d)
        length = lhs_dims[lhs_labels.index(label)]
        out = out_dims[out_labels.index(label)]
        pairs *= sum(
            max(0, min(size, length + low - j * stride) - max(0, low - j * stride))
            for j in range(out)
        )
    batch = out_dims[out_labels.index("b")]
    features = rhs_dims[rhs_labels.index("o")] * rhs_dims[rhs_labels.index("i")]
    dtype = module.operand_arrays(ins.operands[0])
    return 2.0 * batch * features * pairs, dtype[0].dtype if dtype else "bf16"


def _window(attributes: str) -> list[tuple[int, int, int, int]]:
    """(size, low padding, high padding, stride) per spatial dimension of a convolution."""
    match = _WINDOW.search(attributes)
    fields = dict(re.findall(r"(\w+)=([\w.x_\-]+)", match[1])) if match else {}
    sizes = [int(s) for s in fields.get("size", "").split("x") if s]
    pads = [p.split("_") for p in fields.get("pad", "").split("x") if p]
    strides = [int(s) for s in fields.get("stride", "").split("x") if s]
    return [
        (
            size,
            int(pads[d][0]) if d < len(pads) else 0,
            int(pads[d][1]) if d < len(pads) else 0,
            strides[d] if d < len(strides) else 1,
        )
        for d, size in enumerate(sizes)
    ]


# ---- hand-written kernels -------------------------------------------------------------------

_NAME = re.compile(r"^(.*?)(?:\.\d+)?$")
_PAYLOAD = re.compile(r'metadata_payload="tokamax:(\{.*?\})"(?:[ ,}]|$)')
_ATTENTION = re.compile(r"splash_mha|flash")
_GROUPED = re.compile(r"gmm|ragged_?dot")


def kernel_name(ins: Instruction) -> str:
    """A kernel call's name: the op a tokamax GPU kernel's call records (its calls are all
    `mpmd_map`), else the instruction's, without XLA's numeric suffix."""
    op = _payload(ins).get("op", {}).get("__type", "")
    return op.rsplit(".", 1)[-1] if op else _NAME.match(ins.name)[1]


def _kernel_flops(ins: Instruction, module: Module) -> tuple[float, str] | None:
    """(FLOPs, operand dtype) of one call of a kernel, None for a custom call that is no kernel
    this knows (`unknown_kernels` names those that are kernels)."""
    payload = _payload(ins)
    kind = payload.get("op", {}).get("__type", "") if payload else kernel_name(ins)
    floats = [a for o in ins.operands for a in module.operand_arrays(o) if a.dtype[0] in "fb"]
    if _ATTENTION.search(kind.lower()) and floats:
        return _attention(ins, module, floats, payload)
    if _GROUPED.search(kind.lower()) and floats:
        return _grouped(ins, floats)
    return None


def _payload(ins: Instruction) -> dict:
    """The arguments tokamax records in its GPU kernels' calls (empty for other calls)."""
    match = _PAYLOAD.search(ins.attributes.replace('\\"', '"'))
    try:
        return json.loads(match[1]) if match else {}
    except json.JSONDecodeError:
        return {}


def _shape_dims(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in re.search(r"\[([\d,]*)\]", text)[1].split(",") if d)


def _attention(ins: Instruction, module: Module, floats: list[Array], payload: dict):
    """Attention FLOPs: per matmul, 2 x heads x queries x keys x head dim, masked share."""
    if payload:  # tokamax on GPU: q, k as [batch, length, heads, head dim]
        arguments = payload["arguments"]
        q, k = _shape_dims(arguments["q"]), _shape_dims(arguments["k"])
        heads, queries, head_dim, keys = q[0] * q[2], q[1], q[3], k[1]
        block = payload["op"].get("config", {}).get("block_kv", 128)
        causal = (arguments.get("mask") or {}).get("causal_mask") is not None
        blocks = max(1, keys // block)
        share = (blocks + 1) / (2 * blocks) if causal else 1.0
    else:  # splash on TPU: q, k as [..., length, head dim], its block table the grid
        q, k = floats[0].dims, floats[1].dims
        heads, queries, head_dim, keys = math.prod(q[:-2]), q[-2], q[-1], k[-2]
        share = _grid_share(ins, module)
    shaped = {floats[0].dims, floats[1].dims}
    produced = sum(1 for a in ins.results if a.dims in shaped)
    backward = "Vjp" in str(payload.get("op", {}).get("__type", "")) or re.search(
        r"_d(q|kv)", kernel_name(ins)
    )
    matmuls = {0: 2, 1: 3, 2: 4}.get(produced, 5) if backward else 2
    return matmuls * 2.0 * heads * queries * keys * head_dim * share, floats[0].dtype


def _grid_share(ins: Instruction, module: Module) -> float:
    """The share of query x key blocks a splash kernel computes, from its block table (its
    first operand, [heads, query blocks, key blocks visited per query block] or, for dK/dV,
    [heads, query blocks visited per key block, key blocks])."""
    table = module.operand_arrays(ins.operands[0]) if ins.operands else []
    if not table or len(table[0].dims) < 2:
        return 1.0
    rows, columns = table[0].dims[-2:]
    if rows == columns:  # causal: the blocks on and below the diagonal
        return (rows + 1) / (2 * rows)
    return min(rows, columns) / max(rows, columns)


def _grouped(ins: Instruction, floats: list[Array]) -> tuple[float, str]:
    """Grouped matmul FLOPs: 2 x rows x the expert matrix's dimensions."""
    matrices = [a for a in floats + ins.results if len(a.dims) == 3]
    tokens = next((a for a in floats if len(a.dims) == 2), None)
    if not matrices or tokens is None:
        return 0.0, "bf16"
    _, a, b = matrices[0].dims
    width = a if a in tokens.dims else b
    rows = math.prod(tokens.dims) // width
    return 2.0 * rows * a * b, tokens.dtype
