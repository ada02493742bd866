"""Memory traffic of a compiled program from its HLO text: the bytes its top-level ops move in
HBM per run, loops counted by their trip counts (t2t/aot/hlo.py parses the text and counts the
runs).

    hlo_memory.memory_bytes(compiled.as_text())   # per device, for the roofline (t2t/aot/tpu.py)

XLA's cost_analysis() reports 'bytes accessed' with each loop body counted once and every memory
space together; this counts what the roofline's HBM term needs.
"""

from __future__ import annotations

import re

from t2t.aot.hlo import Instruction, Module, _module, executions, shape_bytes

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


def _read_bytes(name: str, full: int, body, users) -> int:
    """Bytes of value `name` (a fused parameter) an op reads: only the slices taken, when every
    use (through bitcasts) is a slice; nothing when it is the buffer a root dynamic-update-slice
    writes in place; else all of it."""
    frontier, taken = [name], 0
    while frontier:
        value = frontier.pop()
        for u in users.get(value, ()):
            if u.opcode == 'bitcast':
                frontier.append(u.name)
            elif u.opcode in _SLICING and u.operands[0] == value:
                taken += shape_bytes(u.shape)
            elif (u.opcode == 'dynamic-update-slice' and u is body[-1]
                  and u.operands[0] == value):
                continue  # in place: the update is counted as the result
            else:
                return full
    return taken


def _op_traffic(i: Instruction, shapes: dict[str, str], module: Module) -> int:
    """Bytes one top-level op reads and writes; slices and in-place updates count what they
    touch (XLA's cost analysis does the same), not the whole buffer."""
    if i.opcode in _ASYNC_MOVES:  # an async copy between HBM and on-chip memory: once
        arrays = _arrays(i.shape)
        k = _ASYNC_MOVES[i.opcode]
        return shape_bytes(arrays[k][0]) if len(arrays) > k else 0
    if i.opcode == 'custom-call' and 'AsyncCollective' in i.attributes:
        return 0  # the collective it wraps counts
    if i.opcode in _SLICING:
        return 2 * hbm_bytes(i.shape)
    if i.opcode == 'dynamic-update-slice':
        return 2 * hbm_bytes(shapes[i.operands[1]])
    result = hbm_bytes(i.shape)
    operand_bytes = [hbm_bytes(shapes[o]) if o in shapes else 0 for o in i.operands]
    if i.opcode != 'fusion' or not i.called:
        return result + sum(operand_bytes)
    body = module.computations.get(i.called[0][1], ())
    if not body:
        return result + sum(operand_bytes)
    users = _users(body)
    params = {int(p.arguments): p.name for p in body if p.opcode == 'parameter'}
    root = body[-1]
    if root.opcode == 'dynamic-update-slice':
        update = {p.name: p.shape for p in body}.get(root.operands[1])
        result = min(result, shape_bytes(update)) if update else result
    return result + sum(_read_bytes(params[k], size, body, users) if k in params and size
                        else size for k, size in enumerate(operand_bytes))


def memory_bytes(hlo) -> float:
    """Bytes the top-level ops of one run read and write (operands + results), loops counted by
    trip count: the memory traffic in the sense of XLA's cost analysis ('bytes accessed': a fusion
    reads its operands and writes its result once, what happens inside it stays on chip; a
    slice reads what it takes, a dynamic-update-slice writes its update in place), which counts
    each loop body once. HBM only: arrays the TPU compiler placed in on-chip memory (a memory
    space S(n) in their layout) count nothing, an async copy between the two (copy-start,
    slice-start) counts its bytes once. Computations run by fusions and scalar reducers are not
    walked; ops that move no data (tuples, parameters, control flow) count nothing."""
    module = _module(hlo)
    fused = {callee for body in module.computations.values() for i in body
             if i.opcode == 'fusion' for _, callee in i.called}
    total = 0.0
    for name, times in executions(module).items():
        if name in fused:
            continue
        body = module.computations.get(name, ())
        shapes = {i.name: i.shape for i in body}
        traffic = sum(_op_traffic(i, shapes, module) for i in body
                      if i.opcode not in _NO_TRAFFIC)
        total += times * traffic
    return total
