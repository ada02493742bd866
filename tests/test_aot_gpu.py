"""GPU ahead-of-time compiles on this CPU (t2t/aot/targets.py, gpu.py; `train.py --dry_run
--topology=8xh100`): XLA's CUDA compiler (the gpu-aot extra) compiles the tiny config's train step
and beam search for one H100 (cuDNN's fused attention) and for two nodes of two H100s (data across
the nodes, fsdp inside each; XLA's softmax), in bf16, and a model too large for the card.

Each compile takes tens of seconds of a core: three processes compile (5 programs), each shared by
the tests that read it (module-scoped fixtures), with scanned layers (a third less compile time,
and the loops counted by trip count on the GPU's program too), in the xdist group of the TPU
compiles so that the worker running them runs no other compile beside them.
"""

import json
import re
import subprocess
import sys

import pytest

from t2t import flops
from t2t.aot import targets
from t2t.aot import tpu as aot
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
    for name, gpus in (('1xh100', 1), ('8xh100', 8), ('8xh200', 8), ('8xa100-80g', 8),
                       ('8xb200', 8), ('2x8xh100', 16)):
        plan = aot.plan(_tiny(batch_size=16 * gpus), name)
        assert plan.mesh.size == gpus and plan.hosts == (2 if name.startswith('2x') else 1)
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
# Several GPUs: fsdp over a node's NVLink, data over the network; XLA's softmax

# Two nodes of two H100s, mesh data=2 (the nodes) x fsdp=2 (in each node): one compile shows both
# axes and both networks (a compile is most of these tests' time).
_NODES = """
import json
from configs import tiny
from t2t.aot import tpu as aot
config = tiny.get_config()
config.dtype, config.attention_impl, config.mesh_shape = 'bfloat16', 'xla', (2, 2, 1)
config.scan_layers = True
plan = aot.plan(config, '2x2xh100')
train = aot.compile_train_step(config, plan.mesh)
predict = aot.compile_predict(config, plan.mesh)
out = {k: dict(total=c.memory.total, arguments=c.memory.arguments,
               fits=aot.verdict(c, plan.target.hbm_bytes), cudnn=c.attention_calls,
               network=vars(c.roofline.network), collective_bytes=c.collective_bytes,
               kinds={k: v.bytes + v.in_loops_bytes for k, v in c.collectives.items()},
               ratio=aot.recompute_ratio(c, config, 4), mesh=dict(plan.mesh.shape),
               nodes=[d.process_index for d in plan.mesh.devices.flat])
       for k, c in (('train', train), ('predict', predict))}
print('RESULT ' + json.dumps(out))
"""


@pytest.fixture(scope='module')
def two_nodes():
    out = subprocess.run([sys.executable, '-c', _NODES], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.split('RESULT ', 1)[1])


def test_fsdp_in_a_node_and_data_across_nodes(two_nodes):
    train, predict = two_nodes['train'], two_nodes['predict']
    assert train['mesh'] == {'data': 2, 'fsdp': 2, 'tensor': 1}
    assert train['nodes'] == [0, 0, 1, 1]  # data splits the nodes, fsdp runs inside each
    for c in (train, predict):
        assert c['fits'] == aot.FITS and c['cudnn'] == [0, 0], c  # XLA's softmax
    assert train['ratio'] == pytest.approx(1.0, abs=0.01)
    params = count_params(abstract_params(TransformerConfig.from_config(_tiny())))
    net = train['network']
    # fsdp inside a node: the parameters gathered over NVLink (at least a bfloat16 copy of the
    # half a device does not hold), nothing of that crosses the network.
    assert train['kinds']['all-gather'] > 0 and net['nvlink_bytes'] >= params
    # data across nodes: the gradients summed over the network (a device's half of them, at
    # least in bfloat16: XLA reduces the matmul weights' before the cast to float32).
    assert net['internode_count'] > 0 and net['internode_bytes'] >= params
    assert net['nvlink_bytes'] + net['internode_bytes'] == pytest.approx(
        train['collective_bytes'], rel=1e-9)
    p = predict['network']
    assert p['nvlink_bytes'] + p['internode_bytes'] == pytest.approx(
        predict['collective_bytes'], rel=1e-9)


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
