"""t2t/aot/hlo.py: FLOPs from compiled HLO text, loops counted by trip count (on the CPU backend;
the TPU compiler's text is checked in tests/test_aot.py)."""

import re

import jax
import jax.numpy as jnp
import pytest

from t2t import sharding
from t2t.aot import cost, hlo
from t2t.aot import memory as hlo_memory
from t2t.aot import tpu as aot
from t2t.infra import flops
from tests.conftest import tiny_config


def _scan_matmuls(w, x):
    def body(c, w_i):
        return jnp.tanh(c @ w_i), None

    y, _ = jax.lax.scan(body, x, w)
    return y


def _compiled_text(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


def test_scan_counted_by_trip_count_with_and_without_xla_known_trip_count():
    w, x = jnp.ones((5, 16, 16)), jnp.ones((4, 16))
    text = _compiled_text(_scan_matmuls, w, x)
    assert list(hlo.while_trip_counts(text).values()) == [5]
    want = 5 * 2 * 4 * 16 * 16
    assert hlo.matmul_flops(text) == want
    # XLA's own count: one body for the whole loop (what the dry run used to print).
    assert jax.jit(_scan_matmuls).lower(w, x).compile().cost_analysis()['flops'] < want / 4
    # The TPU compiler prints loops without known_trip_count: the induction variable's start,
    # step and bound give the same count.
    bare = re.sub(r', backend_config=\{[^\n]*"known_trip_count"[^\n]*\}', '', text)
    assert '"known_trip_count"' not in bare
    assert list(hlo.while_trip_counts(bare).values()) == [5]
    assert hlo.matmul_flops(bare) == want
    # Nested loops multiply; the backward pass of a scan is a second loop.
    nested = _compiled_text(lambda w, x: jax.lax.fori_loop(
        0, 3, lambda i, c: _scan_matmuls(w, c), x), w, x)
    assert sorted(hlo.while_trip_counts(nested).values()) == [3, 5]
    assert hlo.matmul_flops(nested) == 3 * want
    grad = _compiled_text(jax.grad(lambda w, x: _scan_matmuls(w, x).sum()), w, x)
    assert hlo.matmul_flops(grad) == 3 * want  # forward, dx and dW of every step


def test_loop_free_matmuls_and_convolutions_match_xla_cost_analysis():
    """Without loops hlo.py and XLA count the same dots and convolutions (strided, dilated,
    padded and grouped convolutions: only the taps that read real input count)."""
    a, b = jnp.ones((3, 8, 32)), jnp.ones((3, 32, 16))
    image, kernel = jnp.ones((2, 4, 9, 11)), jnp.ones((6, 2, 3, 3))

    def fn(a, b, image, kernel):
        batched = jnp.einsum('bij,bjk->bik', a, b)
        conv = jax.lax.conv_general_dilated(
            image, kernel, window_strides=(2, 1), padding=((1, 2), (0, 1)), lhs_dilation=(2, 1),
            rhs_dilation=(1, 2), feature_group_count=2)
        return batched, conv  # no other ops, which cost_analysis would count too

    compiled = jax.jit(fn).lower(a, b, image, kernel).compile()
    ours = hlo.matmul_flops(compiled.as_text())
    assert ours > 2 * 3 * 8 * 32 * 16  # the convolution counted too
    assert ours == pytest.approx(compiled.cost_analysis()['flops'], rel=0.02)


def test_bad_text_is_an_error():
    with pytest.raises(ValueError, match='no ENTRY computation'):
        hlo.parse('HloModule m\n')


@pytest.mark.parametrize('scan_layers', [False, True])
def test_train_step_flops_match_the_analytic_count(scan_layers):
    """The tiny model's train step on 8 CPU devices: the HLO matmul FLOPs agree with
    t2t/infra/flops.py scanned or not (4 loss chunks: a loop even unrolled), and XLA's
    cost_analysis does not."""
    config = tiny_config(scan_layers=scan_layers, loss_impl='fused', loss_chunk_len=3,
                         vocab_size=512, num_encoder_layers=3, num_decoder_layers=3)
    mesh = sharding.make_mesh(config.mesh_shape)
    compiled = aot.compile_train_step(config, mesh)
    analytic = flops.config_flops_per_step(config)
    matmul = compiled.matmul_flops_per_device * mesh.size
    assert compiled.unknown_loops == 0
    trips = sorted(hlo.while_trip_counts(compiled.hlo_text).values())
    # The loss's 4 chunks; scanned, the 3 layers of each stack forward and backward (the CPU's
    # random bits come from loops too).
    assert trips.count(4) == 1 and trips.count(3) == (4 if scan_layers else 0), trips
    # Above by what flops.py leaves out: the causal half of decoder self-attention is computed in
    # full (12 d L^2 / 2 per row and layer: 7% at 12 tokens).
    causal_rest = 12 * config.d_model * 3 * config.max_len * (
        config.max_len - (config.max_len + 1) / 2) * config.batch_size
    assert matmul == pytest.approx(analytic + causal_rest, rel=0.02)
    if scan_layers:
        assert compiled.flops_per_device * mesh.size < 0.6 * analytic
    # Where the bytes go: the groups of the breakdown sum to the totals the roofline uses.
    shares = cost.breakdown(compiled.hlo_text)
    assert len({s.key for s in shares}) == len(shares) > 10
    assert sum(s.memory_bytes for s in shares) == pytest.approx(
        compiled.memory_bytes_per_device, rel=1e-9)
    assert sum(s.collective_bytes for s in shares) == pytest.approx(
        compiled.collective_bytes, rel=1e-9) and compiled.collective_bytes > 0
    assert sum(s.in_loops_bytes for s in shares) > 0  # the loss's chunk loop at least
    assert all(s.memory_bytes >= 0 and s.collective_bytes >= 0 for s in shares)


def test_collectives_counted_per_kind_inside_and_outside_loops():
    """8 CPU devices: an all-reduce of f32[1, 16] in each of 5 scan steps, then one of each kind
    outside the loop; bytes are the operands' sizes per device."""
    mesh = jax.sharding.Mesh(jax.devices(), ('x',))
    P = jax.sharding.PartitionSpec

    def fn(x_16, w_516):
        def body(c, w_i):
            return jax.lax.psum(jnp.tanh(c * w_i), 'x'), None

        c, _ = jax.lax.scan(body, x_16, w_516)  # c: f32[1, 16] per device, 64 bytes
        return (jax.lax.psum(c, 'x'),
                jax.lax.all_gather(c[0, :2], 'x'),  # operand f32[2]: 8 bytes
                jax.lax.psum_scatter(c + 1, 'x', scatter_dimension=1, tiled=True),
                jax.lax.all_to_all(c.reshape(8, 2) * 2, 'x', 0, 0, tiled=True),
                jax.lax.ppermute(c * 3, 'x', [(i, (i + 1) % 8) for i in range(8)]))

    program = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P('x'), P()),
                                    out_specs=(P(), P(), P('x'), P('x'), P('x')),
                                    check_vma=False))
    text = program.lower(jnp.ones((8, 16)), jnp.ones((5, 16))).compile().as_text()
    got = hlo.collectives(text)
    assert got['all-reduce'] == hlo.Collectives(count=1, bytes=64, in_loops_count=5,
                                                in_loops_bytes=5 * 64)
    assert got['all-gather'] == hlo.Collectives(count=1, bytes=8)
    for kind in ('reduce-scatter', 'all-to-all', 'collective-permute'):
        assert got[kind] == hlo.Collectives(count=1, bytes=64), kind
    # A 3-step loop around it all multiplies and moves everything into loops.
    looped = jax.jit(jax.shard_map(
        lambda x, w: jax.lax.fori_loop(0, 3, lambda i, c: fn(c, w)[0], x), mesh=mesh,
        in_specs=(P('x'), P()), out_specs=P(), check_vma=False))
    text = looped.lower(jnp.ones((8, 16)), jnp.ones((5, 16))).compile().as_text()
    assert hlo.collectives(text)['all-reduce'] == hlo.Collectives(
        in_loops_count=3 * 6, in_loops_bytes=3 * 6 * 64)


def test_memory_bytes_match_xla_without_loops_and_count_loop_bodies_by_trip_count():
    """hlo_memory.memory_bytes: operands + results of the top-level ops, as XLA's 'bytes accessed'
    counts them; a loop body counts once per trip (XLA's: once), its per-step slice of the
    stacked weights counted as the slice, not the stack."""
    a, b, c = jnp.ones((64, 128)), jnp.ones((128, 256)), jnp.ones((64, 256))
    flat = jax.jit(lambda a, b, c: (jnp.tanh(a @ b) + c, (a * 2).sum(0))).lower(a, b, c).compile()
    assert hlo_memory.memory_bytes(flat.as_text()) == pytest.approx(
        flat.cost_analysis()['bytes accessed'], rel=1e-3)
    x = jnp.ones((32, 64))
    ours, xla = {}, {}
    for steps in (5, 9):
        compiled = jax.jit(_scan_matmuls).lower(jnp.ones((steps, 64, 64)), x).compile()
        ours[steps] = hlo_memory.memory_bytes(compiled.as_text())
        xla[steps] = compiled.cost_analysis()['bytes accessed']
    # A step copies its 64x64 slice out of the stack (read + write), the matmul reads it and the
    # 32x64 carry and writes a 32x64 result, tanh reads and writes that: f32, plus a few scalars.
    per_step = (ours[9] - ours[5]) / 4
    assert per_step == pytest.approx(4 * (3 * 64 * 64 + 4 * 32 * 64), rel=0.01)
    assert xla[9] == pytest.approx(xla[5], rel=1e-3)  # XLA: one body whatever the trip count
    assert ours[5] - xla[5] == pytest.approx(4 * per_step, rel=0.01)


def test_loop_extra_puts_back_what_a_once_counted_loop_body_leaves_out():
    """cost.loop_extra_seconds: the cost model's shape summed op by op with loops by trip count
    less the same with each body once (XLA's optimal_seconds counts a body once): n - 1 bodies,
    so from 5 to 9 steps it doubles; no loop, nothing added."""
    x = jnp.ones((32, 64))
    extra = {}
    for steps in (5, 9):
        text = _compiled_text(_scan_matmuls, jnp.ones((steps, 64, 64)), x)
        once = cost.op_seconds(text, 'v5e', loops=False)
        extra[steps] = cost.loop_extra_seconds(text, 'v5e')
        assert extra[steps] == pytest.approx(cost.op_seconds(text, 'v5e') - once, rel=1e-9)
        assert extra[steps] > once  # 4 (8) more bodies, each most of the program
    assert extra[9] == pytest.approx(2 * extra[5], rel=1e-3)  # the condition's compare aside
    # Bytes costed at a given rate: half the rate, twice the time (these ops are memory-bound).
    assert cost.loop_extra_seconds(text, 'v5e', 409.5e9) == pytest.approx(2 * extra[9], rel=1e-3)
    flat = _compiled_text(lambda a, b: jnp.tanh(a @ b), x, jnp.ones((64, 64)))
    assert cost.loop_extra_seconds(flat, 'v5e') == 0.0
    estimate = cost.Estimate('v5e', optimal_seconds=2e-3, loop_extra_seconds=1e-3)
    assert estimate.seconds == 3e-3 and estimate.scale == pytest.approx(1.5)
    # MFU it implies: model FLOPs / time / (devices x 197 TFLOP/s).
    assert estimate.mfu(1e12, 4) == pytest.approx(1e12 / 3e-3 / (4 * 197e12))
    # XLA's number is not always a time (negative for base and big on v5e): no estimate, said.
    roofline = cost.Roofline('v5e', 1e9, 1e6, 1e5)
    bad = aot.Compiled(None, 0.0, 1.0, roofline=roofline, xla_optimal_seconds=-47.0)
    assert cost.estimate_lines(bad, 4, 1e12) == [
        '  XLA ESTIMATE of the step time: none (its cost_analysis gave optimal_seconds -47, '
        'not a time)']
    sliced = aot.Compiled(None, 0.0, 1.0, roofline=roofline, xla_optimal_seconds=-46.99,
                          xla_uncosted=47)
    assert cost.estimate_lines(sliced, 4)[0].startswith(
        '  XLA ESTIMATE of the step time: none (its cost_analysis gave optimal_seconds -46.99: '
        '-1 s for each of 47 custom-calls it cannot cost')
    good = aot.Compiled(None, 0.0, 1.0, roofline=roofline, xla_optimal_seconds=2e-3,
                        estimate=estimate)
    assert cost.estimate_lines(good, 4)[0].endswith('= 3 ms')


def test_token_values_of_multi_slice_programs_hold_no_bytes():
    """Multi-slice programs order their DCN transfers with token[]: no data, no error."""
    assert hlo.shape_bytes('(token[], f32[2,3]{1,0}, bf16[4])') == 2 * 3 * 4 + 4 * 2
    with pytest.raises(ValueError, match="unknown element type 'q7'"):
        hlo.shape_bytes('q7[2]')


_SLICED_PREFETCHES = """HloModule m

%fused (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %join = f32[8]{0} custom-call(%p), custom_call_target="ConcatBitcast"
}

%cond (c: (s32[], f32[8])) -> pred[] {
  %c = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (b: (s32[], f32[8])) -> (s32[], f32[8]) {
  %b = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %x = f32[8]{0} get-tuple-element(%b), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %joined = f32[8]{0} custom-call(%x), custom_call_target="ConcatBitcast"
  %kernel = f32[8]{0} custom-call(%joined), custom_call_target="tpu_custom_call"
  ROOT %t = (s32[], f32[8]{0}) tuple(%next, %kernel)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %zero = s32[] constant(0)
  %joined = f32[8]{0} custom-call(%a), custom_call_target="ConcatBitcast"
  %f = f32[8]{0} fusion(%joined), kind=kLoop, calls=%fused
  %init = (s32[], f32[8]{0}) tuple(%zero, %f)
  %loop = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[8]{0} get-tuple-element(%loop), index=1
}
"""


def test_uncosted_custom_calls_counted_as_xla_sums_them():
    """XLA's cost analysis holds -1 s for each ConcatBitcast it visits: those outside fusions,
    a loop body's once (its sum counts a body once); a Pallas kernel's call has a cost."""
    assert hlo.while_trip_counts(_SLICED_PREFETCHES) == {'loop': 5}
    assert cost.uncosted_custom_calls(_SLICED_PREFETCHES) == 2
    assert cost.uncosted_custom_calls(_SLICED_PREFETCHES.replace('ConcatBitcast', 'x')) == 0
    # A multi-slice program's (tiny on 2 x v5e:2x2: optimal_seconds -35 with 34 + 1 of them).
    assert cost.uncosted_custom_calls(_SLICED_PREFETCHES.replace('ConcatBitcast', 'ZeroCrop')) == 2


_PIECES = '(f32[4]{0}, bf16[64,2]{1,0}, bf16[64,8]{1,0}, bf16[64,8]{1,0})'
_PIECE = """
%acf.# (p0: bf16[64,2], p1: bf16[64,8], p2: f32[4]) -> PIECES {
  %p2.# = f32[4]{0} parameter(2)
  %y.# = f32[4]{0} add(%p2.#, %p2.#)
  %p0.# = bf16[64,2]{1,0} parameter(0)
  %p1.# = bf16[64,8]{1,0} parameter(1)
  %ag.# = bf16[64,8]{1,0} all-gather(%p0.#), channel_id=1, replica_groups={{0,1,2,3}},
    dimensions={1}, frontend_attributes={chain_id="0"}
  ROOT %t.# = PIECES tuple(%y.#, %p0.#, %p1.#, %ag.#)
}
"""


def _chain_piece(k: int) -> str:
    return _PIECE.replace(',\n    dimensions', ', dimensions').replace('#', str(k)).replace(
        'PIECES', _PIECES)


_ALIASED = 'output_to_operand_aliasing={{1}: (0, {}), {2}: (1, {}), {3}: (1, {})}'
# The TPU compiler's async collective fusion, as in big's train step with fsdp alone (the tied
# embedding's all-gather spread over 134 fusions): each piece passes the shard and the gathered
# buffer along (aliased) and runs part of one all-gather into it.
_CHAINED_ALL_GATHER = 'HloModule m\n' + _chain_piece(1) + _chain_piece(2) + f"""
ENTRY %main (s: bf16[64,2], b: bf16[64,8], x: f32[4]) -> (f32[4], bf16[64,8]) {{
  %s = bf16[64,2]{{1,0}} parameter(0)
  %b = bf16[64,8]{{1,0}} parameter(1)
  %x = f32[4]{{0}} parameter(2)
  %f1 = {_PIECES} fusion(%s, %b, %x), kind=kOutput, {_ALIASED}, calls=%acf.1
  %y1 = f32[4]{{0}} get-tuple-element(%f1), index=0
  %s1 = bf16[64,2]{{1,0}} get-tuple-element(%f1), index=1
  %b1 = bf16[64,8]{{1,0}} get-tuple-element(%f1), index=3
  %f2 = {_PIECES} fusion(%s1, %b1, %y1), kind=kOutput, {_ALIASED}, calls=%acf.2
  %y2 = f32[4]{{0}} get-tuple-element(%f2), index=0
  %b2 = bf16[64,8]{{1,0}} get-tuple-element(%f2), index=3
  ROOT %out = (f32[4]{{0}}, bf16[64,8]{{1,0}}) tuple(%y2, %b2)
}}
"""


def test_a_collective_chained_over_fusions_counts_as_one_op():
    """Each piece of a chained all-gather (chain_id) is 1/N of it: the chain's collective bytes
    and HBM bytes are one all-gather's (shard 256 B read, 1024 B gathered written), the buffers
    the pieces pass along cost nothing, and each fusion's own work (16 B read, 16 written)
    counts as before. Counted whole in every piece, big's fsdp-only step had read 30 GB it did
    not (bench/RESULTS.md)."""
    assert hlo.chain_pieces(_CHAINED_ALL_GATHER) == {'ag.1': 2, 'ag.2': 2}
    gathers = hlo.collectives(_CHAINED_ALL_GATHER)['all-gather']
    assert (gathers.count, gathers.bytes) == (1, 64 * 2 * 2)
    assert hlo_memory.memory_bytes(_CHAINED_ALL_GATHER) == 2 * (16 + 16) + 64 * 8 * 2 + 64 * 2 * 2
    shares = cost.breakdown(_CHAINED_ALL_GATHER)
    assert sum(s.memory_bytes for s in shares) == hlo_memory.memory_bytes(_CHAINED_ALL_GATHER)
    # Without the chain attribute each is a whole all-gather of its own (the buffers passed
    # along still cost nothing).
    unchained = _CHAINED_ALL_GATHER.replace(', frontend_attributes={chain_id="0"}', '')
    assert hlo.chain_pieces(unchained) == {}
    assert hlo.collectives(unchained)['all-gather'].count == 2
    assert hlo_memory.memory_bytes(unchained) == 2 * (16 + 16 + 64 * 8 * 2 + 64 * 2 * 2)
