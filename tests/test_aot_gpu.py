"""GPU ahead-of-time compiles on this CPU (t2t/aot/targets.py, gpu.py; `train.py --dry_run
--topology=8xh100`): XLA's CUDA compiler (the gpu-aot extra) compiles the tiny config's train step
and beam search in bf16 for one H100 (cuDNN's fused attention) and for two H100s, data=2 (cuDNN)
and fsdp=2 (XLA's softmax); two collectives on two nodes of two H100s (the network split); and a
model too large for the card.

Each compile takes seconds to tens of seconds of a core: three processes compile (8 programs),
each shared by the tests that read it (module-scoped fixtures), with scanned layers (a third less
compile time, and the loops counted by trip count on the GPU's program too), in the xdist group of
the TPU compiles so that the worker running them runs no other compile beside them.
"""

import functools
import json
import re
import subprocess
import sys

import pytest

from t2t.aot import targets
from t2t.aot import tpu as aot
from t2t.infra import flops
from t2t.model import TransformerConfig, abstract_params, count_params
from tests.conftest import ROOT

pytestmark = pytest.mark.xdist_group('libtpu')


def _env():
    import os

    return {k: v for k, v in os.environ.items() if k not in ('JAX_PLATFORMS', 'XLA_FLAGS')}


def _train_py(*flags, timeout=600, **env):
    cmd = [sys.executable, 'train.py', '--config=configs/tiny.py', '--dry_run', *flags]
    return subprocess.run(cmd, cwd=ROOT, env=dict(_env(), **env), capture_output=True, text=True,
                          timeout=timeout)


def _tiny(**changes):
    from configs import tiny

    config = tiny.get_config()
    for k, v in changes.items():
        setattr(config, k, v)
    return config


# ----------------------------------------------------------------------------------------------
# Names and target descriptions, no compile


def test_gpu_names_map_to_nodes_and_each_description_parses():
    cases = {  # name: (GPUs, nodes, jax topology, device kind, HBM bytes of XLA's description)
        '1xh100': (1, 1, '1x1x1', 'NVIDIA H100 80GB HBM3', 84942979072),
        'h100': (1, 1, '1x1x1', 'NVIDIA H100 80GB HBM3', 84942979072),
        '2xh100': (2, 1, '1x1x2', 'NVIDIA H100 80GB HBM3', 84942979072),
        '8xh100': (8, 1, '1x1x8', 'NVIDIA H100 80GB HBM3', 84942979072),
        '8xH200': (8, 1, '1x1x8', 'NVIDIA H200 141GB HBM3e', 151397597184),
        '8xa100-80g': (8, 1, '1x1x8', 'NVIDIA A100-SXM4-80GB', 85100068864),
        '4xb200': (4, 1, '1x1x4', 'NVIDIA B200', 191514411008),
        '2x8xh100': (16, 2, '2x1x8', 'NVIDIA H100 80GB HBM3', 84942979072),
    }
    for name, (gpus, nodes, topology, kind, hbm) in cases.items():
        target = targets.parse(name)
        assert (target.chips, target.nodes, target.topology, target.hbm_bytes) == (
            gpus, nodes, topology, hbm), name
        assert target.platform == 'cuda' and target.spec.peak_bf16_flops > 0
        devices = targets.devices(target)  # XLA parses the card's description
        assert len(devices) == gpus and {d.device_kind for d in devices} == {kind}, name
        # One host per node (jax's N x 1 x G topology): the network split reads process_index.
        assert [d.process_index for d in devices] == [i // target.per_node for i in range(gpus)]
    assert targets.parse('v5e-16').platform == 'tpu'  # the TPU names keep their meaning
    assert set(targets.GPUS) == {'h100', 'h200', 'a100-80g', 'b200'}
    for bad in ('8xh900', '9xh100', '0xh100', '2x9xh100', '0x8xh100', '8x', 'h100x8', 'gpu'):
        with pytest.raises(ValueError, match=re.escape(f'--topology={bad!r}')) as e:
            targets.parse(bad)
        assert '\n' not in str(e.value)


_BAD_SPECS = """
import sys
from t2t.aot import targets
target = targets.parse('1xh100')
text = targets.spec_text('h100')
# XLA's upstream file as it is: the jax in use rejects collective_memory_granularity (why
# t2t/aot/gpu_specs/ leaves it out); and a field no XLA knows.
upstream = text.replace('  device_interconnect_info {',
                        '  collective_memory_granularity: 2097152\\n  device_interconnect_info {')
for bad in (upstream, text + '\\nbogus_field: 3\\n'):
    try:
        targets.devices(target, spec=bad)
    except ValueError as e:
        print('ERROR ' + repr(str(e)))
"""


def test_a_description_xla_cannot_parse_is_one_line_naming_the_field():
    env = dict(_env(), TF_CPP_MIN_LOG_LEVEL='0')  # the tests' default (3) hides XLA's reason
    out = subprocess.run([sys.executable, '-c', _BAD_SPECS], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    errors = [eval(line[6:]) for line in out.stdout.splitlines() if line.startswith('ERROR ')]
    assert len(errors) == 2, out.stdout + out.stderr
    for message, field in zip(errors, ('collective_memory_granularity', 'bogus_field'),
                              strict=True):
        assert '\n' not in message and field in message, message
        assert message.startswith('--topology=1xh100: XLA cannot read the target description '
                                  'h100_sxm.txtpb: '), message
    assert 'Error parsing' not in out.stderr  # read back for the message, not printed
    # With XLA's log off (here), still one line, saying where the reason is.
    with pytest.raises(ValueError) as e:
        targets.devices(targets.parse('1xh100'), spec=targets.spec_text('h100') + '\nbogus: 1\n')
    assert '\n' not in str(e.value) and 'TF_CPP_MIN_LOG_LEVEL=3 hides it' in str(e.value)


def test_each_target_plans_its_mesh_before_any_compile():
    """The dry run's plan (train.py's path) for every target name: the mesh is resolved over the
    target's devices, and a mesh that does not divide them is one line naming the count."""
    for name, gpus in (('1xh100', 1), ('2xh100', 2), ('8xh100', 8), ('8xh200', 8),
                       ('8xa100-80g', 8), ('8xb200', 8), ('2x8xh100', 16)):
        plan = aot.plan(_tiny(batch_size=16 * gpus), name)
        assert plan.mesh.size == gpus and plan.hosts == (2 if name.startswith('2x8') else 1)
        assert plan.batch_step == gpus
        with pytest.raises(ValueError, match=f'has {gpus} devices'):
            aot.plan(_tiny(mesh_shape=(3, 1, 1)), name)
    with pytest.raises(ValueError, match='attention_impl=splash: splash attention runs on TPU '
                                         'only, the target is gpu'):
        aot.plan(_tiny(attention_impl='splash'), '8xh100')


def test_bad_target_is_one_line():
    out = _train_py('--topology=8xh900', timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    error = out.stderr.strip().splitlines()
    assert error == ["train.py: --topology='8xh900': not GPU nodes of h100, h200, a100-80g, "
                     'b200 (e.g. 8xh100, 1xh200, 2x8xh100: nodes x GPUs per node x card) nor '
                     'a TPU slice (e.g. v5e-16)'], out.stderr


def test_find_max_batch_takes_no_fit_by_xla_recomputation(monkeypatch):
    """--find_max_batch on GPUs, with a stand-in compile on the CPU mesh: above 256 rows XLA
    "fits" by recomputing (its matmul FLOPs per row 20% above the model's, memory kept under the
    card): not a fit unless the config asks for remat."""
    from t2t import sharding
    from t2t.aot import report as aot_report

    def fake_compile(c, mesh):
        model = flops.config_flops_per_step(c, causal_half=False) / mesh.size
        recomputes = c.batch_size > 256
        memory = aot.Memory(arguments=1 << 30, outputs=1 << 30, aliased=1 << 30, code=0,
                            temporaries=min(c.batch_size, 300) * (200 << 20))
        return aot.Compiled(memory, flops_per_device=model, seconds=0.5,
                            matmul_flops_per_device=model * (1.2 if recomputes else 1.0))

    monkeypatch.setattr(aot, 'compile_train_step', fake_compile)
    plan = aot.Plan(targets.parse('8xh100'), sharding.make_mesh((-1, 1, 1)), batch_step=8)
    for remat, want in (('none', 256), ('full', None)):
        lines = []
        status = aot_report.dry_run(_tiny(batch_size=64, remat=remat), plan,
                                    find_max_batch=True, max_tries=12, out=lines.append)
        text = '\n'.join(lines)
        assert status == 0, text
        found = int(re.search(r'largest batch_size that fits: (\d+) ', text).group(1))
        if want is not None:  # 264 rows recompute: no fit; 256 the largest
            assert found == want and '264 does not; exact;' in text, text
            assert 'fits only by rematerialization' in text
        else:  # remat asked: recomputation is the config's, memory decides (no limit here)
            assert found > 256, text


# ----------------------------------------------------------------------------------------------
# The collectives' cost: bytes a GPU sends under NCCL's ring model, no compile

# 16 GPUs on 2 nodes of 8 (device k on node k // 8), one collective of each kind.
_COLLECTIVES = """HloModule m

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (a: bf16[1000000], b: f32[1000], c: f32[2000], d: f32[4000], e: f32[100]) -> f32[] {
  %a = bf16[1000000]{0} parameter(0)
  %b = f32[1000]{0} parameter(1)
  %c = f32[2000]{0} parameter(2)
  %d = f32[4000]{0} parameter(3)
  %e = f32[100]{0} parameter(4)
  %ar = bf16[1000000]{0} all-reduce(%a), replica_groups=[1,16]<=[16], to_apply=%add
  %ag = f32[8000]{0} all-gather(%b), replica_groups=[2,8]<=[16], dimensions={0}
  %rs = f32[1000]{0} reduce-scatter(%c), replica_groups=[8,2]<=[2,8]T(1,0), to_apply=%add
  %aa = f32[4000]{0} all-to-all(%d), replica_groups=[1,16]<=[16], dimensions={0}
  %cp = f32[100]{0} collective-permute(%e), source_target_pairs={{0,1},{1,8}}
  ROOT %z = f32[] constant(0)
}
"""


def test_collective_cost_is_the_bytes_a_gpu_sends_by_ring_and_across_nodes_hierarchically():
    """Hand-computed: an all-reduce of B = 2 MB over all 16 sends 2 x 7/8 x B on NVLink (the
    reduce-scatter and all-gather rings of 8 in each node) and 2 x 1/2 x B/8 on the network (each
    GPU's eighth reduced between the 2 nodes); counted whole on the network, as before, it was
    16x that. An all-gather of a 4 kB shard in each node: 7/8 of the 32 kB it gathers. A
    reduce-scatter of 8 kB between the nodes (groups {k, k + 8}): half of it over the network.
    An all-to-all of 16 kB over all 16: 7/16 to the GPUs of its node, 8/16 to the other's. A
    permute of 400 B, one pair in a node and one across: half of each, a pair's mean."""
    from t2t.aot import gpu

    nodes = [k // 8 for k in range(16)]
    assert gpu.sent_bytes('all-reduce', 2e6, nodes) == pytest.approx((3.5e6, 0.25e6))
    assert gpu.sent_bytes('all-reduce', 2e6, nodes[:8]) == pytest.approx((3.5e6, 0))
    assert gpu.sent_bytes('all-reduce', 2e6, [0, 1]) == pytest.approx((0, 2e6))  # 1 a node
    assert gpu.sent_bytes('all-gather', 4000, nodes[:8]) == pytest.approx((28000, 0))
    assert gpu.sent_bytes('reduce-scatter', 8000, [0, 1]) == pytest.approx((0, 4000))
    assert gpu.sent_bytes('all-to-all', 16000, nodes) == pytest.approx((7000, 8000))
    assert gpu.sent_bytes('all-reduce', 2e6, [0]) == (0, 0)
    net = gpu.network(_COLLECTIVES, nodes)
    assert (net.nvlink_count, net.internode_count) == (1, 4)  # the all-gather stays in a node
    assert net.nvlink_bytes == 4000
    assert net.internode_bytes == 2e6 + 8000 + 16000 + 400
    assert net.nvlink_sent == pytest.approx(3.5e6 + 28000 + 7000 + 200)
    assert net.internode_sent == pytest.approx(0.25e6 + 4000 + 8000 + 200)
    # H100: NVLink 900 GB/s and the network 100 GB/s both ways, so 450 and 50 GB/s one way.
    r = gpu.GpuRoofline('h100', flops=0, memory_bytes=0, network=net,
                        internode_bytes_per_s=100e9)
    assert r.nvlink_s == pytest.approx(3.5352e6 / 450e9)
    assert r.internode_s == pytest.approx(0.2622e6 / 50e9)
    assert r.seconds == pytest.approx(r.nvlink_s + r.internode_s)


def test_replica_groups_in_the_mesh_form_are_read_as_groups_not_all_devices():
    """jax 0.10's XLA writes most replica groups of a mixed mesh as
    mesh[axes], device_ids=(iota) {grouped axes}. A (data 8, fsdp 2) mesh over 16 GPUs, seen in
    its compiled step: the fsdp pairs {2k, 2k + 1} and the data groups of 8 {k, k + 2, ...}.
    Read as all 16 devices (before), a 2-GPU all-gather was costed as a 16-GPU one."""
    from t2t.aot import gpu

    pairs = [[2 * k, 2 * k + 1] for k in range(8)]
    ids = "device_ids=([8,2]T(1,0))"
    assert gpu.groups(f"replica_groups=mesh['axis_0'=1,'axis_1'=2,'axis_2'=8], {ids} "
                      "{'axis_1'}, dimensions={1}", 16) == pairs
    assert gpu.groups(f"replica_groups=mesh['axis_0'=2,'axis_1'=8], {ids} {{'axis_0'}}",
                      16) == pairs
    assert gpu.groups(f"replica_groups=mesh['axis_0'=1,'axis_1'=1,'axis_2'=2,'axis_3'=8], {ids} "
                      "{'axis_3'}", 16) == [list(range(0, 16, 2)), list(range(1, 16, 2))]
    assert gpu.groups("replica_groups=mesh['axis_0'=16,'axis_1'=1] {'axis_0'}", 16) == [
        list(range(16))]
    assert gpu.groups("replica_groups=mesh['a'=2,'b'=2], device_ids=(3,2,1,0) {'a','b'}", 4) == [
        [3, 2, 1, 0]]
    # The 2-GPU all-gather of a 1 MB shard stays in its node: 1 MB over NVLink, none across.
    nodes = [k // 8 for k in range(16)]
    text = _COLLECTIVES.replace('replica_groups=[2,8]<=[16]',
                                f"replica_groups=mesh['axis_0'=2,'axis_1'=8], {ids} {{'axis_0'}}")
    net = gpu.network(text, nodes)
    assert net.nvlink_count == 1 and net.nvlink_sent == pytest.approx(
        3.5e6 + 4000 + 7000 + 200)  # the shard of 4 kB sent once to the pair's other GPU
    with pytest.raises(ValueError, match='replica groups in a form'):
        gpu.groups('replica_groups=<unknown>', 16)


# ----------------------------------------------------------------------------------------------
# One H100: train.py's report, cuDNN attention, bf16


@pytest.fixture(scope='module')
def one_h100():
    out = _train_py('--topology=1xh100', '--config.dtype=bfloat16', '--config.scan_layers=True',
                    '--config.attention_impl=cudnn')
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def _number(pattern: str, text: str) -> list[float]:
    found = re.search(pattern, text)
    assert found, (pattern, text)
    return [float(g) for g in found.groups()]


def test_one_h100_report_fits_with_cudnn_attention(one_h100):
    text = one_h100
    assert 'nodes: 1xh100 (jax topology 1x1x1): 1 GPU on 1 node of up to 8 joined by NVLink, ' \
           'NVIDIA H100 80GB HBM3, 79.11 GiB HBM per GPU' in text
    assert 'mesh: data=1 fsdp=1 tensor=1 (1 devices)' in text
    train, predict = text.split('\npredict (')
    sizes = _number(r'arguments ([\d.]+) MiB, outputs ([\d.]+) MiB, aliased ([\d.]+) MiB, '
                    r'temporaries ([\d.]+) MiB, code ([\d.]+) MiB', train)
    total = _number(r'total ([\d.]+) MiB of 79.11 GiB HBM: fits, ', train)[0]
    assert total == pytest.approx(sizes[0] + sizes[1] - sizes[2] + sizes[3] + sizes[4], abs=0.3)
    # cuDNN's fused attention in both directions: 2 self-attentions + 1 cross per layer pair.
    forward, backward = _number(r'attention kernel compiled: cuDNN fused attention: (\d+) '
                                r'forward \+ (\d+) backward calls', train)
    assert forward == backward == 6
    assert _number(r'cuDNN fused attention: (\d+) forward \+ 0 backward', predict)[0] > 0
    # No recomputation: XLA's matmul FLOPs (cuDNN's counted as the math) are the model's.
    ratio = _number(r'causal self-attention whole\) = ([\d.]+), at most 1.03: no recomputation',
                    train)[0]
    assert ratio == pytest.approx(1.0, abs=0.01)
    # The plain loss's float32 logits, batch x length x vocabulary.
    assert "the loss's largest buffer: f32[16,32,1000] (2.0 MiB)" in train
    assert 'compiled.cost_analysis() is None here' in train
    # The roofline estimate: its sum, and the MFU and tokens/s it implies.
    flop, compute_ms, hbm_bytes, memory_ms, nvlink_ms, net_ms, total_ms = _number(
        r'max\(compute ([\d.e+]+) FLOP = ([\d.e+-]+) ms, HBM ([\d.e+]+) B = ([\d.e+-]+) ms\) \+ '
        r'NVLink ([\d.e+-]+) ms \+ network ([\d.e+-]+) ms = ([\d.e+-]+) ms', train)
    assert compute_ms == pytest.approx(flop / 989e12 * 1e3, rel=5e-3)  # printed to 3 digits
    assert memory_ms == pytest.approx(hbm_bytes / 3.35e12 * 1e3, rel=5e-3)
    assert nvlink_ms == net_ms == 0
    assert total_ms == pytest.approx(max(compute_ms, memory_ms), rel=5e-3)
    model = flops.config_flops_per_step(_tiny())
    mfu, tokens = _number(r'implied by the estimate: MFU ([\d.]+)% .* ([\d.e+]+) target '
                          r'tokens/s per GPU', train)
    assert mfu == pytest.approx(100 * model / (total_ms / 1e3) / 989e12, rel=0.01)
    assert tokens == pytest.approx(16 * 32 / (total_ms / 1e3), rel=0.01)
    assert 'total with the training state' in predict and ': fits, ' in predict


# ----------------------------------------------------------------------------------------------
# Two GPUs: data with cuDNN's attention, fsdp with XLA's softmax; two nodes' network split

# One process compiles the tiny train step and beam search on 2 H100s for data=2 (cuDNN) and
# fsdp=2 (XLA's softmax), then a psum and an all-gather on two nodes of two H100s (mesh data=2
# across the nodes x fsdp=2 inside each, as the dry run builds it): the network split by the real
# compiler's replica groups at the cost of a two-op program, not a third train step.
_TWO_GPUS = """
import json
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from configs import tiny
from t2t.infra import flops
from t2t.aot import gpu
from t2t.aot import tpu as aot
out = {}
for mesh, impl in (((2, 1, 1), 'cudnn'), ((1, 2, 1), 'xla')):
    config = tiny.get_config()
    config.dtype, config.attention_impl, config.mesh_shape = 'bfloat16', impl, mesh
    config.scan_layers = True
    plan = aot.plan(config, '2xh100')
    model = flops.config_flops_per_step(config)
    for run, compile_fn in (('train', aot.compile_train_step), ('predict', aot.compile_predict)):
        c = compile_fn(config, plan.mesh)
        out[f'{run} {"data" if mesh[0] == 2 else "fsdp"}'] = dict(
            mesh=dict(plan.mesh.shape), arguments=c.memory.arguments, total=c.memory.total,
            fits=aot.verdict(c, plan.target.hbm_bytes), cudnn=c.attention_calls,
            kinds={k: v.bytes + v.in_loops_bytes for k, v in c.collectives.items()
                   if v.count + v.in_loops_count},
            network=vars(c.roofline.network), ratio=aot.recompute_ratio(c, config, 2),
            report=gpu.report_lines(c, 2, model if run == 'train' else None, 16 * 32, run))
config = tiny.get_config()
config.mesh_shape = (2, 2, 1)
mesh = aot.plan(config, '2x2xh100').mesh
def fn(x, y):
    return jax.lax.psum(x, 'data'), jax.lax.all_gather(y, 'fsdp', tiled=True)
shard = jax.shard_map(fn, mesh=mesh, in_specs=(P('data'), P('fsdp')),
                      out_specs=(P(), P()), check_vma=False)
args = [jax.ShapeDtypeStruct((2, n), jnp.float32, sharding=NamedSharding(mesh, P(axis)))
        for n, axis in ((1000, 'data'), (500, 'fsdp'))]
text = jax.jit(shard).lower(*args).compile().as_text()
nodes = [d.process_index for d in mesh.devices.flat]
out['two nodes'] = dict(nodes=nodes, network=vars(gpu.network(text, nodes)))
print('RESULT ' + json.dumps(out))
"""


@pytest.fixture(scope='module')
def two_gpus():
    out = subprocess.run([sys.executable, '-c', _TWO_GPUS], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.split('RESULT ', 1)[1])


@functools.cache
def _params() -> int:
    return count_params(abstract_params(TransformerConfig.from_config(_tiny())))


def test_two_gpus_data_parallel_with_cudnn_attention(two_gpus):
    train, predict = two_gpus['train data'], two_gpus['predict data']
    assert train['mesh'] == {'data': 2, 'fsdp': 1, 'tensor': 1}
    for c in (train, predict):
        assert c['fits'] == aot.FITS, c
    assert train['cudnn'] == [6, 6]  # as on one H100: each GPU runs all of its rows' layers
    assert predict['cudnn'][0] > 0 and predict['cudnn'][1] == 0  # the encoder pass, no backward
    assert any(line.startswith('  attention kernel compiled: cuDNN fused attention: 6 forward')
               for line in train['report'])
    assert train['ratio'] == pytest.approx(1.0, abs=0.01)
    # The gradients summed over the two GPUs, each at least in bfloat16, nothing else; a ring
    # of 2 sends its whole buffer once (2 x 1/2), over NVLink.
    assert set(train['kinds']) == {'all-reduce'} and train['kinds']['all-reduce'] >= 2 * _params()
    net = train['network']
    assert net['nvlink_bytes'] == train['kinds']['all-reduce'] == net['nvlink_sent']
    assert net['internode_count'] == net['internode_sent'] == 0
    # Beam search: each GPU decodes its own rows with the whole (replicated) parameters.
    assert predict['kinds'] == {}


def test_two_gpus_fsdp_with_xla_softmax(two_gpus):
    train, predict = two_gpus['train fsdp'], two_gpus['predict fsdp']
    data_train, data_predict = two_gpus['train data'], two_gpus['predict data']
    assert train['mesh'] == {'data': 1, 'fsdp': 2, 'tensor': 1}
    for c in (train, predict):
        assert c['fits'] == aot.FITS and c['cudnn'] == [0, 0], c
        assert '  attention kernel compiled: XLA softmax (no cuDNN fused-attention call)' in \
            c['report']
    assert train['ratio'] == pytest.approx(1.0, abs=0.01)
    # Each GPU holds half of the parameters and Adam's moments: half data-parallel's arguments.
    assert train['arguments'] == pytest.approx(data_train['arguments'] / 2, rel=0.03)
    assert predict['arguments'] == pytest.approx(data_predict['arguments'] / 2, rel=0.03)
    # The other half gathered (at least in bfloat16), the gradients reduce-scattered; no
    # all-to-all (issue 45's item 6: the token lookups read the gathered table); the one
    # all-reduce left sums scalars (the loss's metrics).
    kinds = train['kinds']
    assert kinds['all-gather'] >= _params() and kinds['reduce-scatter'] >= 2 * _params()
    assert 'all-to-all' not in kinds and kinds.get('all-reduce', 0) < 1e-2 * _params()
    # Sent per GPU on a ring of 2: an all-gather's gathered output / 2 = its shard, a
    # reduce-scatter's input / 2, an all-reduce's whole buffer.
    assert train['network']['nvlink_sent'] == pytest.approx(
        kinds['all-gather'] + kinds['reduce-scatter'] / 2 + kinds.get('all-reduce', 0))
    # Beam search gathers the parameters once.
    assert set(predict['kinds']) == {'all-gather'} and predict['kinds']['all-gather'] >= _params()


def test_two_nodes_split_collectives_between_nvlink_and_the_network(two_gpus):
    """Mesh data=2 x fsdp=2 on two nodes of two H100s: data splits the nodes, fsdp runs inside
    each. The psum over data (f32[1, 1000] a GPU: 4000 B) is an all-reduce between the nodes, a
    ring of 2 nodes of 1 GPU: 2 x 1/2 x 4000 B sent over the network; the all-gather over fsdp
    (f32[1, 500]: a 2000 B shard, 4000 gathered) stays in each node: 1/2 x 4000 B over NVLink."""
    two = two_gpus['two nodes']
    assert two['nodes'] == [0, 0, 1, 1]
    net = two['network']
    assert (net['internode_count'], net['internode_bytes'], net['internode_sent']) == (
        1, 4000, 4000)
    assert (net['nvlink_count'], net['nvlink_bytes'], net['nvlink_sent']) == (1, 2000, 2000)


# ----------------------------------------------------------------------------------------------
# Too large for the card: never "fits"


def test_a_model_too_large_for_an_h100_never_fits():
    """The tiny config with d_ff = 2^25 on one H100: 8.6e9 parameters, whose float32 values,
    gradients' Adam moments and updates are more than the card holds. XLA compiles it anyway (a
    compile for a GPU does not fail for memory): the report says it does not fit and exits 1
    without compiling the beam search. XLA plans here for a card 1000x larger (its memory
    limit's slop factor), so that its rematerialization pass does not spend minutes trying to fit
    what cannot (a third of the compile time); the verdict compares with the card's real HBM."""
    out = _train_py('--topology=1xh100', '--config.dtype=bfloat16', '--config.d_ff=33554432',
                    '--config.batch_size=1', '--config.scan_layers=True',
                    XLA_FLAGS='--xla_gpu_memory_limit_slop_factor=100000')
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    total, hbm = _number(r'  total ([\d.]+) GiB of ([\d.]+) GiB HBM: (?:does NOT fit|fits only '
                         r'by rematerialization), ', out.stdout)
    arguments = _number(r'per device: arguments ([\d.]+) GiB', out.stdout)[0]
    assert arguments > hbm == 79.11 and total >= arguments
    assert 'predict: not compiled (the train step ' in out.stdout
    assert ': fits, ' not in out.stdout
    assert "NOT the default compile settings (XLA_FLAGS='--xla_gpu_memory_limit_slop_factor" \
        in out.stdout
