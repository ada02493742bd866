"""Counts from a compiled program's HLO text, loops counted by their trip counts.

    text = compiled.as_text()               # jax's Compiled, after .lower(...).compile()
    hlo.matmul_flops(text)                   # dot + convolution FLOPs of one run, per device
    hlo.while_trip_counts(text)              # {while instruction: trip count, None if unknown}
    runs = hlo.executions(hlo.parse(text))   # {computation: times it runs per run of the entry}
    hlo.collectives(text)                    # {'all-reduce': Collectives(count, bytes, ...), ...}
    hlo.collective_ops(text)                 # each collective: operand types, in a loop, runs

Why: XLA's cost_analysis() counts a while loop's body once, whatever its trip count, so the FLOPs
of scanned layers (one body for all the layers of a stack) and of the fused loss's chunk loop are
undercounted by the trip counts. Here every computation is weighted by how often it runs: the
entry once, a fusion's or call's computation as often as its caller, a while body as often as
its caller times the loop's trip count, each branch of a conditional as often as its caller (an
upper bound: one branch runs). The trip count is XLA's `known_trip_count` backend config where
the text has it (the CPU compiler's), else it is read off the loop's induction variable: started
at a constant, stepped by a constant, compared with a constant (the TPU compiler's loops); a loop
without either counts once and is reported as unknown (None). Scalar computations (reduce, sort,
scatter, collective reductions: `to_apply`) hold no matmuls and are not walked.

FLOPs of a dot: 2 x output elements x the product of the lhs contracting dimensions; of a
convolution: 2 x batch x output features x kernel input features x the (output position, kernel
tap) pairs that read real input, per spatial dimension (the TPU compiler writes batched matmuls
as convolutions with dilated windows that mostly read holes; XLA's cost analysis counts the
same). Elementwise ops, reductions and collectives are not counted: the result is the matmul
work, the number to compare with an analytic model count (t2t/infra/flops.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re

_HEADER = re.compile(r'(ENTRY\s+)?%?([\w.\-]+)\s*[(]')
_INSTRUCTION = re.compile(r'\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)')
_OPCODE = re.compile(r'\s*([\w\-]+)[(]')
_CALLED = re.compile(r'\b(calls|body|condition|true_computation|false_computation)=%?([\w.\-]+)')
_CALLED_LISTS = re.compile(r'\b(branch_computations|called_computations)=\{([^}]*)\}')
_ARRAY = re.compile(r'([a-z]+\d*(?:e\d+m\d+\w*)?)\[([^\]]*)\]')
_CLOSE = {'(': ')', '[': ']', '{': '}'}


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    opcode: str
    shape: str  # the result type as printed: 'bf16[8,256]{1,0}' or a tuple '(s32[], ...)'
    operands: tuple[str, ...]  # operand instruction names
    arguments: str  # the operand list as printed ('2' for constant(2))
    attributes: str  # everything after the operand list
    called: tuple[tuple[str, str], ...]  # (role, computation): ('body', 'region_0.4'), ...


@dataclasses.dataclass(frozen=True)
class Module:
    entry: str
    computations: dict[str, tuple[Instruction, ...]]  # each computation's ROOT last


def _balanced_end(text: str, start: int) -> int:
    """Index just past the bracket group opening at text[start]."""
    stack = []
    for i in range(start, len(text)):
        c = text[i]
        if c in _CLOSE:
            stack.append(_CLOSE[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    raise ValueError(f'unbalanced HLO text: {text[start:start + 80]!r}')


def _split_type(rest: str) -> tuple[str, str]:
    """('bf16[8,256]{1,0:T(8,128)}', rest after it): a type ends at the first top-level space."""
    if rest.startswith('('):
        end = _balanced_end(rest, 0)
        return rest[:end], rest[end:]
    depth = 0
    for i, c in enumerate(rest):
        if c in '([{':
            depth += 1
        elif c in ')]}':
            depth -= 1
        elif c == ' ' and depth == 0:
            return rest[:i], rest[i:]
    return rest, ''


def _parse_instruction(line: str) -> Instruction | None:
    m = _INSTRUCTION.fullmatch(line)
    if not m:
        return None
    name, rest = m.groups()
    shape, rest = _split_type(rest)
    op = _OPCODE.match(rest)
    if not op:
        return None
    open_at = op.end() - 1
    close_at = _balanced_end(rest, open_at)
    operands = tuple(re.findall(r'%([\w.\-]+)', rest[open_at:close_at]))
    attributes = rest[close_at:]
    called = [(role, comp) for role, comp in _CALLED.findall(attributes)]
    for role, names in _CALLED_LISTS.findall(attributes):
        called += [(role, n.strip().lstrip('%')) for n in names.split(',') if n.strip()]
    return Instruction(name, op.group(1), shape, operands, rest[open_at + 1:close_at - 1],
                       attributes, tuple(called))


def parse(hlo_text: str) -> Module:
    """The computations of an HLO module's text (HloModule.to_string / compiled.as_text())."""
    computations, entry, name, body, root = {}, None, None, [], None
    for line in hlo_text.splitlines():
        if name is None:
            if line and not line[0].isspace() and line.rstrip().endswith('{'):
                m = _HEADER.match(line)
                if m and not line.startswith('HloModule'):
                    name, body, root = m.group(2), [], None
                    entry = name if m.group(1) else entry
            continue
        if line.strip() == '}':
            # The ROOT last (the scheduled text usually prints it last anyway).
            computations[name] = tuple([i for i in body if i is not root] + [root]
                                       if root is not None else body)
            name = None
            continue
        instruction = _parse_instruction(line)
        if instruction is not None:
            body.append(instruction)
            if line.lstrip().startswith('ROOT '):
                root = instruction
    if entry is None:
        raise ValueError('no ENTRY computation in the HLO text')
    return Module(entry, computations)


def array_dims(shape: str) -> tuple[int, ...]:
    """Dimensions of an array type 'bf16[8,<=256]{1,0}'; ValueError for a tuple or token."""
    m = _ARRAY.match(shape)
    if not m:
        raise ValueError(f'not an array type: {shape!r}')
    return tuple(int(d.lstrip('<=')) for d in m.group(2).split(',') if d.strip())


def _known_trip_count(instruction: Instruction) -> int | None:
    m = re.search(r'backend_config=(\{.*\})', instruction.attributes)
    if not m:
        return None
    try:
        config = json.loads(m.group(1)[:_balanced_end(m.group(1), 0)])
    except ValueError:
        return None
    n = config.get('known_trip_count', {}).get('n') if isinstance(config, dict) else None
    return int(n) if n is not None else None


def _value(module: Module, computation: str, name: str, params: tuple = ()):
    """What an instruction of a loop's condition or body computes, as far as trip counts need:
    an int (a constant), ('iv', k, step) (element k of the loop tuple plus step), ('cmp',
    direction, a, b), or None. params: the values of a fused computation's parameters."""
    found = [i for i in module.computations.get(computation, ()) if i.name == name]
    if not found:
        return None
    i = found[0]
    operand = (lambda n: _value(module, computation, i.operands[n], params))
    if i.opcode == 'constant':
        try:
            return int(i.arguments)
        except ValueError:
            return None
    if i.opcode in ('copy', 'bitcast', 'convert') and i.operands:
        return operand(0)
    if i.opcode == 'parameter':
        index = int(i.arguments)
        return params[index] if index < len(params) else None
    if i.opcode == 'get-tuple-element' and not params:  # of the loop's own tuple parameter
        source = [p for p in module.computations[computation] if p.name == i.operands[0]]
        m = re.search(r'index=(\d+)', i.attributes)
        if m and source and source[0].opcode == 'parameter':
            return ('iv', int(m.group(1)), 0)
        return None
    if i.opcode in ('add', 'subtract') and len(i.operands) == 2:
        a, b = operand(0), operand(1)
        sign = 1 if i.opcode == 'add' else -1
        if isinstance(a, tuple) and a[0] == 'iv' and isinstance(b, int):
            return ('iv', a[1], a[2] + sign * b)
        if isinstance(b, tuple) and b[0] == 'iv' and isinstance(a, int) and sign == 1:
            return ('iv', b[1], b[2] + a)
        return None
    if i.opcode == 'compare':
        m = re.search(r'direction=(\w+)', i.attributes)
        return ('cmp', m.group(1), operand(0), operand(1)) if m else None
    if i.opcode == 'fusion' and i.called:
        callee = i.called[0][1]
        roots = module.computations.get(callee, ())
        inner = tuple(operand(n) for n in range(len(i.operands)))
        return _value(module, callee, roots[-1].name, inner) if roots else None
    return None


def _root(module: Module, computation: str) -> Instruction | None:
    body = module.computations.get(computation, ())
    return body[-1] if body else None


def trip_count(instruction: Instruction, module: Module | None = None,
               computation: str = '') -> int | None:
    """A while loop's trip count: XLA's known_trip_count, else (module and the computation
    holding the loop given) from its induction variable: a tuple element started at a constant,
    stepped by a constant in the body and compared with a constant in the condition (the loops
    lax.scan makes; the TPU compiler's printed loops carry no known_trip_count). None: unknown."""
    known = _known_trip_count(instruction)
    if known is not None or module is None:
        return known
    roles = dict(instruction.called)
    cond_root, body_root = _root(module, roles.get('condition', '')), _root(
        module, roles.get('body', ''))
    if cond_root is None or body_root is None or body_root.opcode != 'tuple':
        return None
    test = _value(module, roles['condition'], cond_root.name)
    if not (isinstance(test, tuple) and test[0] == 'cmp'):
        return None
    _, direction, a, b = test
    if isinstance(b, tuple) and isinstance(a, int):  # N > i is i < N
        a, b = b, a
        direction = {'GT': 'LT', 'GE': 'LE', 'LT': 'GT', 'LE': 'GE'}.get(direction, direction)
    if not (isinstance(a, tuple) and a[0] == 'iv' and a[2] == 0 and isinstance(b, int)):
        return None
    k = a[1]
    step = (_value(module, roles['body'], body_root.operands[k])
            if k < len(body_root.operands) else None)
    init_tuple = [i for i in module.computations.get(computation, ())
                  if i.name == (instruction.operands or [''])[0]]
    if not (isinstance(step, tuple) and step[0] == 'iv' and step[1] == k and step[2]
            and init_tuple and init_tuple[0].opcode == 'tuple'):
        return None
    init = _value(module, computation, init_tuple[0].operands[k])
    if not isinstance(init, int):
        return None
    s = step[2]
    if direction in ('LT', 'LE') and s > 0:
        end = b + (direction == 'LE')
        return max(0, -(-(end - init) // s))
    if direction in ('GT', 'GE') and s < 0:
        end = b - (direction == 'GE')
        return max(0, -(-(init - end) // -s))
    if direction == 'NE' and (b - init) % s == 0 and (b - init) // s >= 0:
        return (b - init) // s
    return None


def _module(hlo) -> Module:
    return parse(hlo) if isinstance(hlo, str) else hlo


def while_trip_counts(hlo) -> dict[str, int | None]:
    """{while instruction name: known trip count or None}, over every computation."""
    module = _module(hlo)
    return {i.name: trip_count(i, module, name) for name, body in module.computations.items()
            for i in body if i.opcode == 'while'}


def executions(hlo, loops: bool = True) -> dict[str, float]:
    """{computation: times it runs per run of the entry}; an unknown trip count counts once.

    Computations called only through `to_apply` (scalar reducers) are left out. loops=False:
    every loop body and condition once, as XLA's cost_analysis counts them.
    """
    module = _module(hlo)
    runs: dict[str, float] = {}

    def visit(name: str, times: float):
        runs[name] = runs.get(name, 0.0) + times
        for instruction in module.computations.get(name, ()):
            loop = (trip_count(instruction, module, name) if instruction.opcode == 'while'
                    and loops else None)
            for role, callee in instruction.called:
                if role == 'body':
                    visit(callee, times * (1 if loop is None else loop))
                elif role == 'condition':
                    visit(callee, times * (1 if loop is None else loop + 1))
                else:
                    visit(callee, times)

    visit(module.entry, 1.0)
    return runs


def _json_dims(attributes: str, key: str) -> list[int]:
    found = re.search(f'"{key}":\\s*\\[([^\\]]*)\\]', attributes)
    return [int(d) for d in re.findall(r'\d+', found.group(1))] if found else []


def _custom_call_flops(instruction: Instruction, shapes: dict[str, str]) -> float:
    """Matmul FLOPs of the GPU compiler's library calls: a cuBLAS GEMM (2 x result elements x
    the contracted size) and cuDNN's fused attention, counted as the math it does, as a dense
    kernel computes it (forward QK^T and PV: 4 B H Sq Sk D; backward dQ, dK, dV, dP: twice that;
    not the scores a flash kernel recomputes in its backward pass)."""
    target = re.search(r'custom_call_target="([^"]*)"', instruction.attributes)
    target = target.group(1) if target else ''
    if target in ('__cublas$gemm', '__cublas$lt$matmul'):
        result = array_dims(_ARRAY.search(instruction.shape).group(0))
        lhs = array_dims(shapes[instruction.operands[0]])
        contracting = _json_dims(instruction.attributes, 'lhs_contracting_dimensions')
        return 2.0 * math.prod(result) * math.prod(lhs[d] for d in contracting)
    if target.startswith('__cudnn$fmha'):
        # The scores [B, H, Sq, Sk]; the queries (operand 0) B Sq H D elements: B H Sq Sk D.
        scores = _json_dims(instruction.attributes, 'intermediate_tensor_shape[^}]*?"dimensions')
        queries = math.prod(array_dims(shapes[instruction.operands[0]]))
        matmuls = 4 if target.endswith('Backward') else 2
        return 2.0 * matmuls * queries * scores[-1]
    return 0.0


def instruction_flops(instruction: Instruction, shapes: dict[str, str]) -> float:
    """Matmul FLOPs of one dot, convolution, cuBLAS GEMM or cuDNN attention call (0 for any other
    op); shapes: operand types."""
    if instruction.opcode == 'custom-call':
        return _custom_call_flops(instruction, shapes)
    if instruction.opcode not in ('dot', 'convolution'):
        return 0.0
    out = math.prod(array_dims(instruction.shape))
    lhs = array_dims(shapes[instruction.operands[0]])
    if instruction.opcode == 'dot':
        m = re.search(r'lhs_contracting_dims=\{([\d,]*)\}', instruction.attributes)
        contracting = [int(d) for d in m.group(1).split(',') if d] if m else []
        return 2.0 * out * math.prod(lhs[d] for d in contracting)
    kernel = array_dims(shapes[instruction.operands[1]])
    labels = re.search(r'dim_labels=(\w+)_(\w+)->(\w+)', instruction.attributes)
    if not labels:
        raise ValueError(f'convolution {instruction.name} without dim_labels')
    lhs_labels, kernel_labels, out_labels = labels.groups()
    out_dims = array_dims(instruction.shape)
    window = _window(instruction.attributes, sum(c.isdigit() for c in kernel_labels))
    # Per output element: kernel input features x the window taps that land on real input
    # (the TPU compiler writes batched matmuls as convolutions whose dilated windows mostly hit
    # holes); taps counted per spatial dimension over all output positions, as XLA's cost
    # analysis does.
    features = kernel[kernel_labels.index('i')]
    non_spatial = math.prod(size for label, size in zip(out_labels, out_dims, strict=True)
                            if not label.isdigit())
    taps = 1
    for d in range(len(window)):
        taps *= _valid_taps(lhs[lhs_labels.index(str(d))], out_dims[out_labels.index(str(d))],
                            kernel[kernel_labels.index(str(d))], *window[d])
    return 2.0 * non_spatial * features * taps


def _window(attributes: str, rank: int) -> list[tuple[int, int, int, int]]:
    """(stride, padding low, lhs dilation, rhs dilation) per spatial dimension."""
    m = re.search(r'window=\{([^}]*)\}', attributes)
    fields = dict(f.split('=', 1) for f in m.group(1).split()) if m else {}

    def ints(key, default):
        if key not in fields:
            return [default] * rank
        return [int(v.split('_')[0]) for v in fields[key].split('x')]

    return list(zip(ints('stride', 1), ints('pad', 0), ints('lhs_dilate', 1),
                    ints('rhs_dilate', 1), strict=True))


@functools.lru_cache(maxsize=4096)
def _valid_taps(size_in: int, size_out: int, size_kernel: int, stride: int, pad_low: int,
                lhs_dilate: int, rhs_dilate: int) -> int:
    """(output position, kernel tap) pairs of one spatial dimension that read a real input."""
    dilated = (size_in - 1) * lhs_dilate + 1
    count = 0
    for tap in range(size_kernel):
        for out in range(size_out):
            p = out * stride + tap * rhs_dilate - pad_low
            count += 0 <= p < dilated and p % lhs_dilate == 0
    return count


def matmul_flops(hlo) -> float:
    """Dot and convolution FLOPs of one run of the module, loops counted by trip count."""
    module = _module(hlo)
    total = 0.0
    for name, times in executions(module).items():
        body = module.computations.get(name, ())
        shapes = {i.name: i.shape for i in body}
        total += times * sum(instruction_flops(i, shapes) for i in body)
    return total


COLLECTIVE_KINDS = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all',
                    'collective-permute')
# Bytes per element of the HLO element types (sub-byte types rounded up to a byte). token[] orders
# a multi-slice program's DCN transfers and holds no data.
_DTYPE_BYTES = {'token': 0, 'pred': 1, 's8': 1, 'u8': 1, 's4': 1, 'u4': 1, 's16': 2, 'u16': 2,
                'f16': 2, 'bf16': 2, 's32': 4, 'u32': 4, 'f32': 4, 's64': 8, 'u64': 8, 'f64': 8,
                'c64': 8, 'c128': 16}


def shape_bytes(shape: str) -> int:
    """Bytes of every array in a type ('bf16[8,256]{1,0}' or a tuple of them); f8 types: 1."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        size = _DTYPE_BYTES.get(dtype, 1 if dtype.startswith('f8') else None)
        if size is None:
            raise ValueError(f'unknown element type {dtype!r} in {shape!r}')
        total += size * math.prod(int(d.lstrip('<=')) for d in dims.split(',') if d.strip())
    return total


@dataclasses.dataclass(frozen=True)
class Collectives:
    """One kind of collective in one run of a module, per device. bytes: the sizes of the
    operands (what each device hands to the collective: the full buffer of an all-reduce or
    reduce-scatter, the shard of an all-gather). count / bytes: those outside any while loop;
    in_loops_*: those inside loops, each counted as often as it runs (times the trip counts)."""

    count: int = 0
    bytes: int = 0
    in_loops_count: int = 0
    in_loops_bytes: int = 0


def _runs_by_loop(module: Module) -> dict[tuple[str, bool], float]:
    """{(computation, inside a while loop): times it runs per run of the entry}: `executions`
    split by whether the call path goes through a while body or condition. An async-done
    (or -update) names the computation its async-start already ran: not counted again."""
    runs: dict[tuple[str, bool], float] = {}

    def visit(name: str, times: float, in_loop: bool):
        runs[name, in_loop] = runs.get((name, in_loop), 0.0) + times
        for instruction in module.computations.get(name, ()):
            if instruction.opcode in ('async-done', 'async-update'):
                continue
            loop = (trip_count(instruction, module, name) if instruction.opcode == 'while'
                    else None)
            for role, callee in instruction.called:
                if role == 'body':
                    visit(callee, times * (1 if loop is None else loop), True)
                elif role == 'condition':
                    visit(callee, times * (1 if loop is None else loop + 1), True)
                else:
                    visit(callee, times, in_loop)

    visit(module.entry, 1.0, False)
    return runs


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction of the module: its kind, operand types, whether it sits in a
    while loop and how often it runs per run of the module."""

    kind: str  # one of COLLECTIVE_KINDS
    name: str
    operand_shapes: tuple[str, ...]
    in_loop: bool
    times: float
    computation: str = ''  # the computation holding it (a loop body, the entry, ...)
    op_name: str = ''  # jax's op_name metadata: the traced operation it came from

    @property
    def bytes(self) -> int:
        return sum(shape_bytes(s) for s in self.operand_shapes)


_CHAIN_ID = re.compile(r'chain_id="(\d+)"')


def chain_pieces(hlo) -> dict[str, int]:
    """{collective instruction: how many pieces its chain has}, for the collectives the TPU
    compiler split over a chain of async collective fusions: each piece (a copy of one collective,
    frontend attribute chain_id, its own async_collective_fusion_config flags) runs a part of the
    steps of one collective into a buffer the chain passes along, so a piece is 1/N of it.
    Collectives in no chain are absent."""
    module = _module(hlo)
    chains: dict[tuple[str, str, str], list[str]] = {}
    for body in module.computations.values():
        for i in body:
            chain = _CHAIN_ID.search(i.attributes)
            if chain and i.opcode.removesuffix('-start') in COLLECTIVE_KINDS:
                chains.setdefault((i.opcode, chain.group(1), i.shape), []).append(i.name)
    return {name: len(names) for names in chains.values() for name in names}


def collective_ops(hlo) -> list[CollectiveOp]:
    """Every collective of the module (synchronous ops and async '-start' halves, never the
    '-done' halves; one wrapped in an async-start's computation counts there), with how often it
    runs: loops by trip count, unknown trip counts once (see `while_trip_counts`); a piece of a
    chain (`chain_pieces`) runs 1/N of a time, so a chain counts as its one collective."""
    module = _module(hlo)
    pieces = chain_pieces(module)
    ops = []
    for (name, in_loop), times in _runs_by_loop(module).items():
        body = module.computations.get(name, ())
        shapes = {i.name: i.shape for i in body}
        for i in body:
            kind = i.opcode.removesuffix('-start')
            if kind in COLLECTIVE_KINDS:
                op_name = re.search(r'op_name="([^"]*)"', i.attributes)
                ops.append(CollectiveOp(kind, i.name, tuple(shapes[o] for o in i.operands),
                                        in_loop, times / pieces.get(i.name, 1), name,
                                        op_name.group(1) if op_name else ''))
    return ops


def collectives(hlo) -> dict[str, Collectives]:
    """{kind: Collectives} for each of COLLECTIVE_KINDS, per device per run of the module
    (the sums of `collective_ops`)."""
    found = {kind: [0.0, 0.0, 0.0, 0.0] for kind in COLLECTIVE_KINDS}
    for op in collective_ops(hlo):
        counts = found[op.kind]
        counts[2 * op.in_loop] += op.times
        counts[2 * op.in_loop + 1] += op.times * op.bytes
    return {kind: Collectives(*(int(round(v)) for v in c)) for kind, c in found.items()}

