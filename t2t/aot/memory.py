"""Memory traffic of a compiled program from its HLO text: the bytes its top-level ops move in
HBM per run, loops counted by their trip counts (t2t/aot/hlo.py parses the text and counts the
runs).

    hlo_memory.memory_bytes(compiled.as_text())   # per device, for the roofline (t2t/aot/cost.py)
    hlo_memory.op_traffic(compiled.as_text())     # the same, op by op: what carries the bytes

XLA's cost_analysis() reports 'bytes accessed' with each loop body counted once and every memory
space together; this counts what the roofline's HBM term needs.
"""

from __future__ import annotations

import dataclasses
import re

from t2t.aot.hlo import (
    COLLECTIVE_KINDS,
    Instruction,
    Module,
    _module,
    chain_pieces,
    executions,
    shape_bytes,
)

# Ops that move no data of their own: tuple plumbing, control flow (their computations count),
# parameters and constants (read by the ops that use them), the '-done' halves of async pairs.
_NO_TRAFFIC = {'parameter', 'constant', 'tuple', 'get-tuple-element', 'bitcast', 'while',
               'conditional', 'call', 'after-all', 'partition-id', 'replica-id', 'iota',
               'async-done', 'async-update', 'all-reduce-done', 'all-gather-done',
               'collective-permute-done', 'copy-done', 'send-done', 'recv-done',
               'slice-done', 'opt-barrier'}


_SLICING = ('dynamic-slice', 'slice', 'gather')
_LAYOUT_ARRAY = re.compile(r'([a-z]+\d*(?:e\d+m\d+\w*)?)\[([^\]]*)\](\{[^}]*\})?')
_ASYNC_MOVES = {'copy-start': 0, 'slice-start': 1}  # which array of the result is the copy


def _arrays(shape: str) -> list[tuple[str, bool]]:
    """Each array of a type ('f32[8]{0:T(8)S(1)}' or a tuple) as (its own type, in HBM): the TPU
    compiler marks arrays it placed in on-chip memory (VMEM, SMEM) with a memory space S(n)."""
    return [(f'{dtype}[{dims}]', not re.search(r'S\([1-9]', layout or ''))
            for dtype, dims, layout in _LAYOUT_ARRAY.findall(shape)]


def hbm_bytes(shape: str) -> int:
    """shape_bytes of the arrays of a type that live in HBM (no on-chip memory space)."""
    return sum(shape_bytes(a) for a, in_hbm in _arrays(shape) if in_hbm)


def _users(body) -> dict[str, list[Instruction]]:
    users: dict[str, list[Instruction]] = {}
    for i in body:
        for o in i.operands:
            users.setdefault(o, []).append(i)
    return users


def _elements(shape: str) -> list[str]:
    """The top-level element types of a tuple type ('(f32[2]{0}, (s32[], f32[3]))'), or [shape]."""
    if not shape.startswith('('):
        return [shape]
    out, depth, start = [], 0, 1
    for k, c in enumerate(shape):
        if c in '([{':
            depth += 1
        elif c in ')]}':
            depth -= 1
        if (c == ',' and depth == 1) or (c == ')' and depth == 0):
            out.append(shape[start:k].strip())
            start = k + 1
    return [e for e in out if e]


def _in_place(body) -> dict[str, int]:
    """{dynamic-update-slice: index of the fusion result it is}: the updates a fusion writes in
    place, its root or an element of its root tuple (through bitcasts)."""
    by_name = {i.name: i for i in body}
    root = body[-1]
    outputs = list(root.operands) if root.opcode == 'tuple' else [root.name]
    found = {}
    for k, name in enumerate(outputs):
        i = by_name.get(name)
        while i is not None and i.opcode == 'bitcast':
            i = by_name.get(i.operands[0])
        if i is not None and i.opcode == 'dynamic-update-slice':
            found[i.name] = k
    return found


def _read_bytes(name: str, full: int, body, users, module: Module, in_place=()) -> int:
    """Bytes of value `name` (a fused parameter) an op reads: only the slices taken, when every
    use (through bitcasts, and into nested fusions) is a slice; nothing when it is the buffer a
    dynamic-update-slice writes in place (in_place: those of the fusion's results); else all of
    it."""
    frontier, taken = [name], 0
    while frontier:
        value = frontier.pop()
        for u in users.get(value, ()):
            if u.opcode == 'bitcast':
                frontier.append(u.name)
            elif u.opcode in _SLICING and u.operands[0] == value:
                taken += shape_bytes(u.shape)
            elif (u.opcode == 'dynamic-update-slice' and u.name in in_place
                  and u.operands[0] == value):
                continue  # in place: the update is counted as the result
            elif u.opcode == 'fusion' and u.called:  # what the nested fusion's parameter reads
                inner = module.computations.get(u.called[0][1], ())
                params = {int(p.arguments): p.name for p in inner if p.opcode == 'parameter'}
                for k, operand in enumerate(u.operands):
                    if operand == value:
                        if k not in params:
                            return full
                        taken += _read_bytes(params[k], full, inner, _users(inner), module)
                        if taken >= full:
                            return full
            else:
                return full
    return min(taken, full)


_ALIASING = re.compile(r'output_to_operand_aliasing=\{(.*?)\}(?:, [a-z_]+=|$)')


def _aliased(i: Instruction) -> dict[int, int]:
    """{result element: operand} of a fusion that writes those results into its operands'
    buffers (output_to_operand_aliasing)."""
    found = _ALIASING.search(i.attributes)
    return {int(out): int(operand) for out, operand in
            re.findall(r'\{(\d+)\}: \((\d+), \{\}\)', found.group(1))} if found else {}


def _chained(i: Instruction, body, users, pieces: dict[str, int], size) -> tuple[dict, dict]:
    """What a fusion carrying a piece of a chained collective (hlo.chain_pieces) moves of the
    chain's buffers: ({result element: bytes written}, {parameter: bytes read}). The buffers it
    passes along unchanged (a parameter returned as the result aliased to it) cost nothing; the
    piece of the collective reads and writes 1/N of its operand and result. The collective's
    own traffic is the collective term's; this keeps one chain's HBM bytes those of one op."""
    aliased = _aliased(i)
    if not aliased:
        return {}, {}
    by_name = {b.name: b for b in body}
    root = body[-1]
    outputs = list(root.operands) if root.opcode == 'tuple' else [root.name]
    params = {b.name: int(b.arguments) for b in body if b.opcode == 'parameter'}
    written, read, free = {}, {}, set()
    for k, name in enumerate(outputs):
        b = by_name.get(name)
        while b is not None and b.opcode == 'bitcast':
            b = by_name.get(b.operands[0])
        if b is None:
            continue
        if b.opcode == 'parameter' and aliased.get(k) == params[b.name]:
            written[k], free = 0, free | {b.name}
        elif b.name in pieces and b.opcode.removesuffix('-start') in COLLECTIVE_KINDS:
            written[k] = size(b.shape) / pieces[b.name]
            for o in b.operands:
                if o in params:
                    read[o] = read.get(o, 0) + size(by_name[o].shape) / pieces[b.name]
    # A parameter only passed along, or only read by the piece, reads that much; others as usual.
    reads = {}
    for p in set(free) | set(read):
        if all(u is root or u.name in pieces for u in users.get(p, ())):
            reads[p] = read.get(p, 0)
    return written, reads


def _op_traffic(i: Instruction, shapes: dict[str, str], module: Module, size=hbm_bytes,
                pieces: dict[str, int] | None = None) -> float:
    """Bytes one top-level op reads and writes; slices and in-place updates count what they
    touch (XLA's cost analysis does the same), not the whole buffer; a piece of a chained
    collective its share of it (`_chained`). size: the bytes of a type that count (hbm_bytes:
    those in HBM; shape_bytes: every memory space, as XLA counts)."""
    if i.opcode in _ASYNC_MOVES:  # an async copy between HBM and on-chip memory: once
        arrays = _arrays(i.shape)
        k = _ASYNC_MOVES[i.opcode]
        return shape_bytes(arrays[k][0]) if len(arrays) > k else 0
    if i.opcode == 'custom-call' and 'AsyncCollective' in i.attributes:
        return 0  # the collective it wraps counts
    if i.opcode in _SLICING:
        return 2 * size(i.shape)
    if i.opcode == 'dynamic-update-slice':
        return 2 * size(shapes[i.operands[1]])
    operand_bytes = [size(shapes[o]) if o in shapes else 0 for o in i.operands]
    body = module.computations.get(i.called[0][1], ()) if i.opcode == 'fusion' and i.called \
        else ()
    if not body:
        return size(i.shape) + sum(operand_bytes)
    users = _users(body)
    params = {int(p.arguments): p.name for p in body if p.opcode == 'parameter'}
    in_place = _in_place(body)
    # The result: each element written whole, but an in-place update only its update's bytes.
    elements = _elements(i.shape)
    written = {k: shape_bytes({p.name: p.shape for p in body}[u.operands[1]])
               for u in body if u.name in in_place for k in [in_place[u.name]]}
    chain_written, chain_read = _chained(i, body, users, pieces or {}, size)
    result = sum(chain_written[k] if k in chain_written else
                 min(size(e), written[k]) if k in written else size(e)
                 for k, e in enumerate(elements))
    return result + sum(
        chain_read[params[k]] if k in params and params[k] in chain_read else
        _read_bytes(params[k], n, body, users, module, in_place) if k in params and n else n
        for k, n in enumerate(operand_bytes))


@dataclasses.dataclass(frozen=True)
class OpTraffic:
    """One top-level op's memory traffic: bytes per run of the op, and how often it runs."""

    computation: str  # the computation holding it (the entry, a loop body, ...)
    name: str
    opcode: str
    op_name: str  # jax's op_name metadata: the traced operation it came from ('' if none)
    bytes: float  # read + written per run of the op (a piece of a chained collective: its share)
    times: float  # runs per run of the module (loops by trip count)

    @property
    def total(self) -> float:
        return self.times * self.bytes


def op_traffic(hlo, all_spaces: bool = False, loops: bool = True) -> list[OpTraffic]:
    """Every top-level op that moves data, with its bytes (see memory_bytes) and runs.

    all_spaces: count arrays in on-chip memory too (XLA's 'bytes accessed'); loops=False: each
    loop body once, as XLA's cost_analysis does."""
    module = _module(hlo)
    fused = {callee for body in module.computations.values() for i in body
             if i.opcode == 'fusion' for _, callee in i.called}
    size = shape_bytes if all_spaces else hbm_bytes
    pieces = chain_pieces(module)
    ops = []
    for name, times in executions(module, loops).items():
        if name in fused:
            continue
        body = module.computations.get(name, ())
        shapes = {i.name: i.shape for i in body}
        for i in body:
            if i.opcode not in _NO_TRAFFIC:
                op_name = re.search(r'op_name="([^"]*)"', i.attributes)
                ops.append(OpTraffic(name, i.name, i.opcode, op_name.group(1) if op_name else '',
                                     _op_traffic(i, shapes, module, size, pieces), times))
    return ops


def memory_bytes(hlo, all_spaces: bool = False, loops: bool = True) -> float:
    """Bytes the top-level ops of one run read and write (operands + results), loops counted by
    trip count: the memory traffic in the sense of XLA's cost analysis ('bytes accessed': a fusion
    reads its operands and writes its result once, what happens inside it stays on chip; a
    slice reads what it takes, a dynamic-update-slice writes its update in place), which counts
    each loop body once. HBM only: arrays the TPU compiler placed in on-chip memory (a memory
    space S(n) in their layout) count nothing, an async copy between the two (copy-start,
    slice-start) counts its bytes once. Computations run by fusions and scalar reducers are not
    walked; ops that move no data (tuples, parameters, control flow) count nothing. The sum of
    op_traffic (its flags the same)."""
    return sum(op.total for op in op_traffic(hlo, all_spaces, loops))
