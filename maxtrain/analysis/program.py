"""What a traced or compiled training step really does: the operand dtypes of its matmuls, the
bytes its collectives move, the copies it makes of its inputs, its matmul FLOPs, its scatters,
gathers and sorts, its grouped matmuls.

`tools/benchmark.py` prints it beside the step time, and the quantization tests assert it,
so a
quantization rule that silently matches nothing shows up as float matmuls.
"""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from maxtrain.kernels.grouped_matmul import SCOPE

# Primitives that do a matmul's work (ragged_dot lowers to ragged_dot_general).
_MATMULS = frozenset({"dot_general", "ragged_dot_general", "ragged_dot"})


def matmul_dtypes(fn: Callable[..., Any], *args: Any) -> collections.Counter:
    """How often each (primitive, operand dtypes) matmul occurs in fn's traced program,
    nested programs (scan, remat, shard_map, custom_vjp) included: what actually multiplies.

    A Pallas kernel (tokamax's attention and grouped matmul on GPU/TPU) counts as one entry,
    `pallas_call <kernel name>`, with the dtypes of its first two matrix operands: what the
    kernel is handed, e.g. int8 weights for the quantized grouped matmul. Its body is not
    searched, since how a kernel multiplies inside is its own business (H100's quantized
    grouped matmul scales its int8 weights to bf16 in registers).
    """
    counts: collections.Counter = collections.Counter()

    def walk(jaxpr: jax.extend.core.Jaxpr) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in _MATMULS:
                dtypes = tuple(str(v.aval.dtype) for v in eqn.invars[:2])
                counts[(eqn.primitive.name, dtypes)] += 1
            elif eqn.primitive.name == "pallas_call":
                matrices = [v for v in eqn.invars if getattr(v.aval, "ndim", 0) >= 2]
                dtypes = tuple(str(v.aval.dtype) for v in matrices[:2])
                counts[(f"pallas_call {eqn.params.get('name')}", dtypes)] += 1
                continue
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return counts


# ---- collectives of a compiled program --------------------------------------------------------

COLLECTIVES = {
    "all-to-all": "all-to-all",
    "ragged-all-to-all": "ragged-all-to-all",
    "all-gather": "all-gather",
    "all-gather-start": "all-gather",
    "reduce-scatter": "reduce-scatter",
    "all-reduce": "all-reduce",
    "all-reduce-start": "all-reduce",
    "collective-permute": "collective-permute",
    "collective-permute-start": "collective-permute",
}
_DTYPE_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2}
_DTYPE_BYTES |= {"bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_DTYPE_BYTES |= {"f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1, "f8e4m3fnuz": 1}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(")
_CALLEE = re.compile(r"\b(?:body|calls|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
_CONDITION = re.compile(r"\bcondition=%([\w.\-]+)")
_CONSTANT = re.compile(r"%([\w.\-]+) = s32\[\][^=]* constant\((\d+)\)")
_LESS_THAN = re.compile(
    r"^\s*ROOT %[\w.\-]+ = pred\[\][^=]* compare\(%([\w.\-]+), "
    r"%([\w.\-]+)\), direction=LT"
)


def _shape_bytes(text: str) -> list[int]:
    """Bytes of each array in an HLO shape (an array or a tuple of them)."""
    sizes = []
    for dtype, dims in _ARRAY.findall(text):
        if dtype in _DTYPE_BYTES:
            count = 1
            for d in filter(None, dims.split(",")):
                count *= int(d)
            sizes.append(count * _DTYPE_BYTES[dtype])
    return sizes


def collective_bytes(hlo_text: str, device_slices: Sequence[int] | None = None) -> dict[str, int]:
    """Bytes per collective kind that one execution of a compiled program moves, per device.

    Each collective counts its whole buffer as the program declares it (the larger of its
    operands and its result: an all-gather's output, a reduce-scatter's input), times how often
    it runs: a collective inside a loop (a scan over layers) counts once per iteration, by the
    trip count XLA records. A loop whose trip count only the run decides (the expert-parallel
    exchange's overflow rounds, parallel/experts.py) is apart: its collectives count once
    per trip under "<kind> per loop trip", not in the kind's total. Read from
    `jax.jit(f).lower(...).compile().as_text()`, so it sees the collectives the SPMD
    partitioner inserted as well as those written by hand.

    device_slices: the slice of each device of the program, in its device order (the mesh's
    devices, flattened). Then a collective whose groups (or, for a collective-permute, whose
    source-target pairs) join devices of different slices also counts under "dcn <kind>": the
    traffic that crosses the data-center network.
    """
    totals: dict[str, int] = collections.Counter()
    for kind, moved, attributes in _collectives(hlo_text):
        if _MEGASCALE.search(attributes):  # a TPU program's transfer to other slices: DCN only
            totals[f"dcn {kind}"] += moved
            continue
        totals[kind] += moved
        if device_slices is not None and _crosses_slices(attributes, device_slices):
            totals[f"dcn {kind}"] += moved
    return dict(totals)


def collective_bytes_per_axis(
    hlo_text: str, mesh_shape: dict[str, int], device_slices: Sequence[int] | None = None
) -> dict[str, dict[str, int]]:
    """`collective_bytes` by the mesh axes each collective runs over, ICI and DCN apart:
    {"ici": {"all-gather fsdp": bytes, "all-reduce data+fsdp": ...}, "dcn": {...}}.

    The axes of a collective are those along which the devices of one of its groups differ
    (device i of the program is the mesh's i-th device, flattened: its mesh coordinates are
    i unravelled over mesh_shape, in the mesh's axis order). A collective joining devices of
    several slices (device_slices) counts under "dcn", the rest under "ici".

    The TPU compiler builds a multi-slice program per slice: its collectives join the devices
    of one slice (device i is then the slice's i-th, over the slice's own shape), and what
    crosses slices is a transfer to the DCN runtime (a `send` marked for "megascale"), counted
    under "dcn" over the axes that span slices."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    coords = np.array(np.unravel_index(np.arange(int(np.prod(sizes))), sizes))  # [axes, devices]
    slices = np.asarray(device_slices) if device_slices else np.zeros(coords.shape[1], int)
    dcn_axes = [n for a, n in enumerate(names) if _varies_with(coords[a], slices)]
    partitions = re.search(r"\bnum_partitions=(\d+)", hlo_text)
    if partitions and int(partitions[1]) < coords.shape[1]:  # one slice's program
        sizes = [len(set(coords[a][slices == 0])) for a in range(len(names))]
    totals: dict[str, dict[str, int]] = {"ici": collections.Counter(), "dcn": collections.Counter()}
    for kind, moved, attributes in _collectives(hlo_text):
        if _MEGASCALE.search(attributes):
            totals["dcn"][f"{kind} {'+'.join(dcn_axes)}"] += moved
            continue
        groups = device_groups(attributes) or [list(range(int(np.prod(sizes))))]
        members = [np.array(np.unravel_index(group, sizes)) for group in groups]
        varying = {names[a] for m in members for a in range(len(names)) if len(set(m[a])) > 1}
        axes = "+".join(n for n in names if n in varying) or "none"
        network = "dcn" if device_slices and _crosses_slices(attributes, device_slices) else "ici"
        totals[network][f"{kind} {axes}"] += moved
    return {network: dict(counts) for network, counts in totals.items()}


def _varies_with(axis_coords: np.ndarray, slices: np.ndarray) -> bool:
    """Whether devices of different slices differ along this axis (a DCN-spanning axis)."""
    return any(len(set(axis_coords[slices == s])) < len(set(axis_coords)) for s in set(slices))


def _trip_count(attributes: str, computations: dict[str, list[str]]) -> int | None:
    """How often a while loop runs, if the program says: the trip count XLA records (CPU, GPU),
    or else a condition `counter < constant` (the TPU compiler's final program drops the
    record; jax's scans and fori_loops count from 0). None for a loop whose bound is a value
    only the run knows."""
    if match := _TRIP_COUNT.search(attributes):
        return int(match.group(1))
    condition = _CONDITION.search(attributes)
    lines = computations.get(condition.group(1), []) if condition else []
    constants = dict(_CONSTANT.findall("\n".join(lines)))
    for line in lines:
        if (compare := _LESS_THAN.search(line)) and compare.group(2) in constants:
            return int(constants[compare.group(2)])
    return None


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    """A compiled program's computations (name -> its instruction lines) and the ENTRY's name."""
    computations: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        match = _COMPUTATION.match(line)
        if match:
            current = match.group(1)
            computations[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif current is not None and line.strip() and line.strip() != "}":
            computations[current].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


def _callees(attributes: str) -> list[str]:
    """The computations an instruction runs: a loop's body, a fusion's or call's, the branches."""
    callees = _CALLEE.findall(attributes)
    for branches in _BRANCHES.findall(attributes):
        callees += re.findall(r"%([\w.\-]+)", branches)
    return callees


class Executed(NamedTuple):
    """One instruction of a compiled program as it runs: its name, result shape, opcode and the
    rest of its line (operands, attributes), how often one execution of the program runs it,
    whether it sits in a loop whose trip count only the run knows (then `times` counts one
    trip of that loop), and the while instructions it sits in, outermost first."""

    name: str
    shape: str
    opcode: str
    rest: str
    times: int
    unknown_loop: bool
    loops: tuple[str, ...] = ()


def executed(hlo_text: str) -> Iterator[Executed]:
    """Every instruction one execution of a compiled program runs, from the ENTRY through the
    computations it calls (loop bodies, fusions, calls, branches), each with how often it runs:
    a loop's body counts once per trip, by the trip count the program states; a loop whose trip
    count only the run decides counts once, marked. Instruction names are unique in a module,
    so a caller may look operands up by name across computations."""
    computations, entry = _computations(hlo_text)

    def visit(name: str, times: int, unknown: bool, loops: tuple) -> Iterator[Executed]:
        for line in computations.get(name, []):
            match = _INSTRUCTION.match(line)
            if match is None:
                continue
            result, shape, opcode, rest = match.groups()
            yield Executed(result, shape, opcode, rest, times, unknown, loops)
            trips = _trip_count(rest, computations) if opcode == "while" else None
            inner = unknown or (opcode == "while" and trips is None)
            within = (*loops, result) if opcode == "while" else loops
            for callee in _callees(rest):
                yield from visit(callee, times * (trips or 1), inner, within)

    yield from visit(entry, 1, False, ())


def _operands(rest: str) -> list[str]:
    """The names of an instruction's operands (the part of its line before the first `)`)."""
    return re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])


def _collectives(hlo_text: str) -> Iterator[tuple[str, int, str]]:
    """(kind, bytes moved per device and step, HLO attributes) of every collective a compiled
    program runs, a loop's counted once per trip (see `collective_bytes`)."""
    shapes: dict[str, list[int]] = {}
    for op in executed(hlo_text):
        shapes[op.name] = _shape_bytes(op.shape)
        suffix = " per loop trip" if op.unknown_loop else ""
        kind = COLLECTIVES.get(op.opcode)
        if kind is not None:
            operand_bytes = [sum(shapes.get(o, [0])) for o in _operands(op.rest)]
            if op.opcode.endswith("-start") or op.opcode == "ragged-all-to-all":
                moved = max([*shapes[op.name], *operand_bytes])  # input and output buffers
            else:
                moved = max(sum(shapes[op.name]), sum(operand_bytes))
            yield kind + suffix, op.times * moved, op.rest
        elif op.opcode == "send" and (transfer := _MEGASCALE.search(op.rest)):
            kind = transfer[1].lower().replace("_", "-")
            yield kind + suffix, op.times * shapes[op.name][0], op.rest


# ---- matmul FLOPs of a compiled program -------------------------------------------------------

_DIMS = re.compile(r"^[a-z][a-z0-9]*\[([0-9,]*)\]")
_LHS_CONTRACTING = re.compile(r"\blhs_contracting_dims=\{([\d,]*)\}")


class Dot(NamedTuple):
    """A dot of a compiled program, as `dots` counts it."""

    shape: list[int]  # its result's dimensions
    depth: int  # the product of its contracted dimensions

    @property
    def flops(self) -> int:
        """2 per multiply-add."""
        return 2 * math.prod(self.shape) * self.depth


def dots(hlo_text: str) -> Iterator[tuple[Dot, Executed]]:
    """Each dot one execution of a compiled program runs, with its instruction (whose `times`
    says how often: a loop's counted once per trip, fusions' and every branch's included; a
    loop whose trip count only the run knows, once)."""
    dims: dict[str, list[int]] = {}
    for op in executed(hlo_text):
        if array := _DIMS.match(op.shape):
            dims[op.name] = [int(d) for d in array.group(1).split(",") if d]
        if op.opcode == "dot":
            lhs = dims[_operands(op.rest)[0]]
            contracted = _LHS_CONTRACTING.search(op.rest).group(1).split(",")
            depth = math.prod(lhs[int(i)] for i in contracted if i)
            yield Dot(dims[op.name], depth), op


def matmul_flops(hlo_text: str) -> int:
    """FLOPs of the dots one execution of a compiled program runs (2 per multiply-add), a loop's
    counted once per trip, fusions' and every branch's included.

    XLA's cost analysis (`compiled.cost_analysis()["flops"]`) counts a while loop's body once,
    whatever its trip count, so the work of a scan (over layers, or over a sequence's chunks:
    kernels/gated_delta_rule.py) does not grow with its length there; this does. A loop
    whose trip count only the run knows counts once. Custom calls (Pallas kernels, LAPACK's
    triangular solve on CPU) are not dots and count nothing."""
    return sum(op.times * dot.flops for dot, op in dots(hlo_text))


# ---- permutations of a compiled program ------------------------------------------------------

_PERMUTING = frozenset({"scatter", "gather", "sort"})
_LAYOUT = re.compile(r"\{[^{}]*\}")


def permutation_ops(hlo_text: str) -> collections.Counter:
    """How often one execution of a compiled program runs a scatter, a gather or a sort, by
    (opcode, result shape without layout): `("scatter", "f32[512,64]")`, a sort of keys and
    their positions `("sort", "(s32[512], s32[512])")`. A loop's counted once per trip (by the
    trip count the program states; once for a loop only the run bounds), fusions' included.

    What the MoE's permutation costs is read here: a scatter whose result is as many rows as
    a device's tokens or assignments is a pass of read-modify-writes over them (slow on GPUs,
    and what autodiff makes of a gather's backward), a sort of the assignments a pass XLA
    cannot fuse; tests/layers/test_moe_permutation.py holds the MoE layer to its budget."""
    counts: collections.Counter = collections.Counter()
    for op in executed(hlo_text):
        if op.opcode in _PERMUTING:
            counts[(op.opcode, _LAYOUT.sub("", op.shape))] += op.times
    return counts


# The grouped matmul's instructions: a dot where ragged_dot lowers densely (CPU), XLA's own
# ragged dot, or a kernel's or library's custom call.
_GROUPED_MATMUL_OPS = frozenset({"dot", "ragged-dot", "custom-call"})
_OP_NAME = re.compile(r'op_name="([^"]*)"')


class GroupedMatmulRun(NamedTuple):
    """A grouped matmul of a compiled program, as `grouped_matmuls` counts it."""

    forward: bool  # in the forward pass; else in the backward (with its recomputations)
    shape: str  # its result, without layout
    in_loop: bool  # in a loop whose trip count only the run knows (counted once)


def grouped_matmuls(hlo_text: str) -> collections.Counter:
    """How often one execution of a compiled program runs a grouped matmul
    (kernels/grouped_matmul.py), by `GroupedMatmulRun`; a loop's counted once per trip,
    as `permutation_ops` does.

    Read from the instructions' metadata: the grouped matmul's name scope, and whether autodiff
    named the instruction under a `transpose(`, as it does everything of the backward pass
    (remat's recomputation of the forward and a custom VJP's replay included, so those count
    as backward). The metadata is not part of JAX's persistent-cache key by default: a program
    loaded from the cache carries the names of whichever identical program filled it, so
    compile what this reads with `jax_compilation_cache_include_metadata_in_key` on. Kernel
    calls without metadata go uncounted: tokamax's Pallas calls in a program compiled for a
    TPU topology (v5e:2x2, on CPU) have none; `kernels` names those."""
    counts: collections.Counter = collections.Counter()
    for op in executed(hlo_text):
        name = _OP_NAME.search(op.rest) if op.opcode in _GROUPED_MATMUL_OPS else None
        if name is None or not re.search(rf"[/(]{SCOPE}[/)]", name[1]):
            continue
        forward = "transpose(" not in name[1]
        counts[GroupedMatmulRun(forward, _LAYOUT.sub("", op.shape), op.unknown_loop)] += op.times
    return counts


def loop_trip_counts(hlo_text: str) -> list[int]:
    """The trip count of every while loop in a compiled program that states one (scans over
    layers, over a sequence's chunks), in the program's order; loops whose bound only the run
    knows are left out."""
    computations, _ = _computations(hlo_text)
    counts = []
    for lines in computations.values():
        for line in lines:
            match = _INSTRUCTION.match(line)
            if match is not None and match.group(3) == "while":
                trips = _trip_count(match.group(4), computations)
                counts += [trips] if trips is not None else []
    return counts


_GROUPS = re.compile(r"\b(?:replica_groups|source_target_pairs)=(\{\{[\d,{}\s]*\}\}|\{\})")
_IOTA_GROUPS = re.compile(r"\breplica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH_GROUPS = re.compile(r"\breplica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


def device_groups(attributes: str) -> list[list[int]] | None:
    """The device groups of a collective's HLO attributes, in the forms XLA writes: listed
    (`{{0,1},{2,3}}`), iota (`[groups,size]<=[dims]T(perm)`), over named mesh axes
    (`mesh['a'=2,'b'=4] {'b'}`: the devices that differ only along b), or a collective-permute's
    source-target pairs. None when the instruction names none (all devices are one group)."""
    if match := _IOTA_GROUPS.search(attributes):
        shape, dims, perm = (
            [int(x) for x in group.split(",")] if group else None for group in match.groups()
        )
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        return ids.transpose(perm).reshape(shape).tolist() if perm else ids.reshape(shape).tolist()
    if match := _MESH_GROUPS.search(attributes):
        axes = re.findall(r"'([^']+)'=(\d+)", match[1])
        names, sizes = [name for name, _ in axes], [int(size) for _, size in axes]
        over = [names.index(name) for name in re.findall(r"'([^']+)'", match[2])]
        ids = np.arange(int(np.prod(sizes))).reshape(sizes)
        kept = [i for i in range(len(sizes)) if i not in over]
        width = int(np.prod([sizes[i] for i in over]))
        return ids.transpose(kept + over).reshape(-1, width).tolist()
    if match := _GROUPS.search(attributes):
        groups = re.findall(r"\{([\d,\s]*)\}", match[1])
        listed = [[int(x) for x in group.split(",") if x.strip()] for group in groups]
        return listed if any(listed) else None  # `{}`: all devices, one group
    if "replica_groups=" in attributes or "source_target_pairs=" in attributes:
        raise ValueError(f"unrecognised device groups in: {attributes[:200]}")
    return None


def _crosses_slices(attributes: str, device_slices: Sequence[int]) -> bool:
    groups = device_groups(attributes)
    if groups is None:
        return len(set(device_slices)) > 1
    return any(len({device_slices[d] for d in group}) > 1 for group in groups)


# ---- copies of a compiled program's inputs ----------------------------------------------------


def entry_parameter_copies(hlo_text: str) -> list[tuple[str, int]]:
    """The copies a compiled program makes of its own inputs, as (name, bytes): instructions of
    the ENTRY computation that copy one of its parameters. A train step's inputs are the state
    it donates, so a copy of one is a pass over memory the math did not ask for (XLA inserts
    them when an input must outlive the output written into its buffer)."""
    entry = hlo_text[hlo_text.index("\nENTRY") :]
    entry = entry[: entry.index("\n}")]
    parameters: set[str] = set()
    copies = []
    for line in entry.splitlines()[1:]:
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        result, shape, opcode, rest = match.groups()
        if opcode == "parameter":
            parameters.add(result)
        elif opcode == "copy" and re.match(r"\s*%([\w.\-]+)", rest)[1] in parameters:
            copies.append((result, sum(_shape_bytes(shape))))
    return copies


# ---- kernels of a compiled program ------------------------------------------------------------

# custom-call targets of hand-written kernels: Pallas on TPU (Mosaic) and GPU (Mosaic GPU,
# Triton), and cuDNN's fused attention.
_KERNEL_TARGETS = re.compile(
    r'custom_call_target="(tpu_custom_call|mosaic_gpu[\w]*|'
    r'__gpu\$xla\.gpu\.triton|__cudnn\$[\w]+)"'
)


def kernels(hlo_text: str) -> dict[str, int]:
    """The hand-written kernels a compiled program calls, by name, with how many call sites
    each has (a kernel inside a loop counts once): what shows a configured kernel really made
    it into the program rather than a fallback to plain XLA. A Pallas kernel's call is named
    after the kernel (`splash_mha_fwd_segmented_residuals.14`: the suffix is dropped)."""
    counts: collections.Counter = collections.Counter()
    for line in hlo_text.splitlines():
        target = _KERNEL_TARGETS.search(line)
        match = _INSTRUCTION.match(line) if target else None
        if match is not None:
            name = re.sub(r"\.\d+$", "", match.group(1))
            counts[
                name if target.group(1) == "tpu_custom_call" else f"{target.group(1)} {name}"
            ] += 1
    return dict(sorted(counts.items()))


class MissingKernel(RuntimeError):
    """A kernel the config asks for is not in the compiled program (a silent fallback)."""


# What each configured kernel's calls are named in a compiled program (`kernels`).
_ATTENTION_KERNELS = {
    "splash": r"^splash_mha",
    "mosaic_tpu": r"^splash_mha",  # tokamax's TPU kernel is splash attention too
    "mosaic_gpu": r"^mosaic_gpu",
    "triton": r"triton",
    "cudnn": r"^__cudnn",
}
# tokamax's Pallas grouped matmuls are `pallas_tpu_ragged_dot_gmm`/`_tgmm` on TPU; XLA's own
# ragged dot (`ragged-dot-none`, what tokamax falls back to for matrices under 128 wide on TPU)
# is not one of them.
_GROUPED_MATMUL_KERNELS = {"tokamax": r"ragged_dot|gmm"}


def check_kernels(model: Any, compute: Any, found: dict[str, int], context: int = 1) -> None:
    """Raises MissingKernel if the attention or grouped-matmul kernel `compute` (a
    ComputeConfig whose choices are made: training/run_model.py) names for `model` (a
    ModelConfig) is missing from `found` (`kernels`).

    context: the mesh's context degree. Above 1 the sequence is split over devices and its
    attention runs as blocks in plain XLA inside the context exchange
    (parallel/context.py), whatever compute.attention says: no attention kernel is due."""
    attention = _ATTENTION_KERNELS.get(compute.attention) if context == 1 else None
    wanted = [("compute.attention", compute.attention, attention)]
    if model.moe is not None:
        impl = compute.grouped_matmul
        wanted.append(("compute.grouped_matmul", impl, _GROUPED_MATMUL_KERNELS.get(impl)))
    for key, impl, pattern in wanted:
        if pattern and not any(re.search(pattern, name) for name in found):
            raise MissingKernel(
                f"{key}={impl} but the compiled program calls no such kernel (kernels: "
                f"{', '.join(found) or 'none'}): it fell back to plain XLA"
            )
