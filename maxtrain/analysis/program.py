"""What a traced or compiled training step really does: the operand dtypes of its matmuls, the
bytes its collectives move, the copies it makes of its inputs, its matmul FLOPs, its scatters,
gathers and sorts, its grouped matmuls.

`tools/benchmark.py` prints it beside the step time, and the quantization tests assert it,
so a quantization rule that silently matches nothing shows up as float matmuls.
"""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax

from maxtrain.kernels.attention import program_call
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


# ---- reading a compiled program -------------------------------------------------------------

DTYPE_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2}
DTYPE_BYTES |= {"bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
DTYPE_BYTES |= {"f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1, "f8e4m3fnuz": 1}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(")
_CALLEE = re.compile(r"\b(?:body|calls|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CONDITION = re.compile(r"\bcondition=%([\w.\-]+)")
_CONSTANT = re.compile(r"%([\w.\-]+) = [su]32\[\][^=]* constant\((\d+)\)")
_LESS_THAN = re.compile(
    r"^\s*ROOT %[\w.\-]+ = pred\[\][^=]* compare\(%([\w.\-#]+), "
    r"%([\w.\-]+)\), direction=LT"
)


def shape_bytes(text: str) -> list[int]:
    """Bytes of each array in an HLO shape (an array or a tuple of them)."""
    sizes = []
    for dtype, dims in _ARRAY.findall(text):
        if dtype in DTYPE_BYTES:
            count = 1
            for d in filter(None, dims.split(",")):
                count *= int(d)
            sizes.append(count * DTYPE_BYTES[dtype])
    return sizes


def trip_count(attributes: str, computations: dict[str, list[str]]) -> int | None:
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


def parse_computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
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


def callees(attributes: str) -> list[str]:
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
    computation: str = ""  # the computation it belongs to
    loops: tuple[str, ...] = ()  # the while loops it runs inside, outermost first


def executed(hlo_text: str) -> Iterator[Executed]:
    """Every instruction one execution of a compiled program runs, from the ENTRY through the
    computations it calls (loop bodies, fusions, calls, branches), each with how often it runs:
    a loop's body counts once per trip, by the trip count the program states; a loop whose trip
    count only the run decides counts once, marked. Instruction names are unique in a module,
    so a caller may look operands up by name across computations."""
    computations, entry = parse_computations(hlo_text)

    def visit(name: str, times: int, unknown: bool, loops: tuple) -> Iterator[Executed]:
        for line in computations.get(name, []):
            match = INSTRUCTION.match(line)
            if match is None:
                continue
            result, shape, opcode, rest = match.groups()
            yield Executed(result, shape, opcode, rest, times, unknown, name, loops)
            trips = trip_count(rest, computations) if opcode == "while" else None
            inner = unknown or (opcode == "while" and trips is None)
            within = (*loops, result) if opcode == "while" else loops
            for callee in callees(rest):
                yield from visit(callee, times * (trips or 1), inner, within)

    yield from visit(entry, 1, False, ())


def operand_names(rest: str) -> list[str]:
    """The names of an instruction's operands (the part of its line before the first `)`)."""
    return re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])


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
            lhs = dims[operand_names(op.rest)[0]]
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


def bytes_accessed(hlo_text: str) -> int:
    """Bytes one execution of a compiled program reads and writes, as XLA's cost analysis
    counts them, but with a loop's body counted once per trip: XLA counts it once, so a scan
    over layers or chunks hides all of its trips but one. Each instruction reads its operands
    and writes its result; a fusion is counted at its boundary (_fusion_traffic). Within 1% of
    XLA:CPU's figure for a program without loops. Arrays count their logical size: XLA:TPU's
    own figure counts tiled buffers, narrow arrays padded to the tile (8 x 128 for float32)."""
    computations, _ = parse_computations(hlo_text)
    parsed = {name: _parsed(lines) for name, lines in computations.items()}
    sizes = {op[0]: sum(shape_bytes(op[1])) for ops in parsed.values() for op in ops}
    fused = {c for ops in parsed.values() for op in ops if op[2] == "fusion"
             for c in _CALLEE.findall(op[3])}  # fmt: skip
    inside = {op[0] for c in fused for op in parsed[c]}
    total = 0
    for op in executed(hlo_text):
        if op.name in inside or op.opcode in _NO_TRAFFIC:
            continue
        operands = [sizes.get(o, 0) for o in operand_names(op.rest)]
        if op.opcode == "fusion":
            traffic = _fusion_traffic(parsed[_CALLEE.search(op.rest).group(1)], operands, sizes)
        else:
            traffic = sum(operands) + sizes[op.name]
        total += op.times * traffic
    return total


def _parsed(lines: list[str]) -> list[tuple]:
    """A computation's instructions as (name, shape, opcode, rest of the line, is the root)."""
    return [
        (*m.groups(), line.lstrip().startswith("ROOT"))
        for line in lines
        if (m := INSTRUCTION.match(line))
    ]


def _fusion_traffic(body: list[tuple], operands: list[int], sizes: dict) -> int:
    """A fusion's bytes as XLA counts them: an operand that is only sliced is read as far as
    its slices reach; one updated in place by the root (a dynamic-update-slice: a scan writing
    one trip's row of its stacked output) is not read, and only the update is written."""
    params = {op[0]: int(op[3].split(")")[0]) for op in body if op[2] == "parameter"}
    users: dict[str, list[tuple[str, str, int]]] = {n: [] for n in params}
    for name, _, opcode, rest, _ in body:
        for position, operand in enumerate(operand_names(rest)):
            if operand in users:
                users[operand].append((name, opcode, position))
    root = next(op for op in body if op[4])
    updated = root[0] if root[2] == "dynamic-update-slice" else None
    total = sizes[root[0]] if updated is None else sizes[operand_names(root[3])[1]]
    for name, index in params.items():
        uses = users[name]
        if uses and all(opcode in ("slice", "dynamic-slice") for _, opcode, _ in uses):
            total += min(operands[index], sum(sizes[user] for user, _, _ in uses))
        elif not (updated and uses == [(updated, "dynamic-update-slice", 0)]):
            total += operands[index]
    return total


# Instructions that name or forward buffers, or run other computations (counted themselves).
_NO_TRAFFIC = frozenset(
    {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
     "conditional"}
)  # fmt: skip


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
    computations, _ = parse_computations(hlo_text)
    counts = []
    for lines in computations.values():
        for line in lines:
            match = INSTRUCTION.match(line)
            if match is not None and match.group(3) == "while":
                trips = trip_count(match.group(4), computations)
                counts += [trips] if trips is not None else []
    return counts


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
        match = INSTRUCTION.match(line)
        if match is None:
            continue
        result, shape, opcode, rest = match.groups()
        if opcode == "parameter":
            parameters.add(result)
        elif opcode == "copy" and re.match(r"\s*%([\w.\-]+)", rest)[1] in parameters:
            copies.append((result, sum(shape_bytes(shape))))
    return copies


def copy_count(hlo_text: str) -> int:
    """How many copy instructions a compiled program holds, in any computation, fusions
    included (each once, however often it runs). On XLA:CPU most are transposes into the
    layout a dot wants its operand in, fused into the loops that produce it: einsums that
    read an array in another order than it was written cost one each. The bytes hardly show
    them; the count does (tests/training/test_step_program.py bounds it)."""
    matches = (INSTRUCTION.match(line) for line in hlo_text.splitlines())
    return sum(1 for m in matches if m is not None and m.group(3) == "copy")


# ---- kernels of a compiled program ------------------------------------------------------------

# custom-call targets of hand-written kernels: Pallas on TPU (Mosaic) and GPU (Mosaic GPU,
# Triton), and cuDNN's fused attention.
KERNEL_TARGETS = re.compile(
    r'custom_call_target="(tpu_custom_call|mosaic_gpu[\w]*|'
    r'__gpu\$xla\.gpu\.triton|__cudnn\$[\w]+)"'
)


_TOKAMAX_OP = re.compile(r'__type\\?":\\?"[\w.]*\.(\w+)\\?"')


def kernels(hlo_text: str) -> dict[str, int]:
    """The hand-written kernels a compiled program calls, by name, with how many call sites
    each has (a kernel inside a loop counts once): what shows a configured kernel really made
    it into the program rather than a fallback to plain XLA. A Pallas kernel's call is named
    after the kernel (`splash_mha_fwd_segmented_residuals.14`: the suffix is dropped); a
    tokamax GPU kernel, whose calls are all `mpmd_map`, after the op its call records
    (`mosaic_gpu_v2 PallasMosaicGpuRaggedDot`)."""
    counts: collections.Counter = collections.Counter()
    for line in hlo_text.splitlines():
        target = KERNEL_TARGETS.search(line)
        match = INSTRUCTION.match(line) if target else None
        if match is not None:
            op = _TOKAMAX_OP.search(line)
            name = op[1] if op else re.sub(r"\.\d+$", "", match.group(1))
            counts[
                name if target.group(1) == "tpu_custom_call" else f"{target.group(1)} {name}"
            ] += 1
    return dict(sorted(counts.items()))


class MissingKernel(RuntimeError):
    """A kernel the config asks for is not in the compiled program (a silent fallback)."""


# tokamax's Pallas grouped matmuls are `pallas_tpu_ragged_dot_gmm`/`_tgmm` on TPU; XLA's own
# ragged dot (`ragged-dot-none`, what tokamax falls back to for matrices under 128 wide on TPU)
# is not one of them.
_GROUPED_MATMUL_KERNELS = {"tokamax": r"ragged_dot|RaggedDot|gmm"}


def check_kernels(model: Any, compute: Any, found: dict[str, int], context: int = 1) -> None:
    """Raises MissingKernel if the attention or grouped-matmul kernel `compute` (a
    ComputeConfig whose choices are made: training/run_model.py) names for `model` (a
    ModelConfig) is missing from `found` (`kernels`).

    context: the mesh's context degree. Above 1 the sequence is split over devices and its
    attention runs as blocks in plain XLA inside the context exchange
    (parallel/context.py), whatever compute.attention says: no attention kernel is due. Nor
    is one for DeepSeek sparse attention's sparse stage (model.mla.indexer), whose attention
    over the gathered keys is plain XLA (kernels/sparse_attention.py)."""
    indexer = model.mla.indexer if model.mla is not None else None
    sparse = indexer is not None and indexer.stage == "sparse"
    attention = program_call(compute.attention) if context == 1 and not sparse else None
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
