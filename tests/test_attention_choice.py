"""attention_impl's resolution (t2t/attention_choice.py): the rules against jax's own checks, and
the kernels a compile for an H100 gets, counted in the compiled module on this CPU (XLA's GPU
compiler, the jax[cuda12] plugin; no GPU needed)."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import topologies

from configs import tiny
from t2t import attention_choice, optim, sharding, train_lib
from t2t.aot import hlo
from t2t.aot import tpu as aot
from t2t.attention import dot_product_attention, make_attention_mask
from t2t.eval import predict as predict_lib
from t2t.model import TransformerConfig
from t2t.run import cli
from tests.conftest import ROOT

H100 = f'{ROOT}/t2t/aot/gpu_specs/h100_sxm.txtpb'
CUDNN_CALL = re.compile(r'custom_call_target="(__cudnn\$fmha\w*)"')


def _config(**changes):
    config = tiny.get_config()
    config.dtype = 'bfloat16'
    config.update(changes)
    return config


# ----------------------------------------------------------------------------------------------
# The rules


@pytest.mark.parametrize('platform, capability, changes, impl, why', [
    ('gpu', None, {}, 'cudnn', 'cuDNN flash attention: bfloat16, head dim 8;'),
    ('gpu', (9, 0), {'d_model': 1024, 'num_heads': 4}, 'cudnn', 'head dim 256;'),
    ('gpu', None, {'d_model': 1024, 'num_heads': 4}, 'xla',
     'not cuDNN: head dim 256 (d_model=1024 / num_heads=4): cuDNN takes multiples of 8 up to 128 '
     'on a CPU host compiling ahead of time'),
    ('gpu', (8, 0), {'d_model': 48}, 'xla', 'head dim 12'),
    ('gpu', (7, 0), {}, 'xla', 'needs compute capability >= 8.0 (Ampere), the GPU has 7.0'),
    ('gpu', None, {'dtype': 'float32'}, 'xla',
     'not cuDNN: dtype=float32: cuDNN flash attention takes bfloat16 or float16'),
    ('gpu', None, {'attention_dropout_rate': 0.1}, 'xla', 'only the written-out softmax (xla)'),
    ('gpu', None, {'max_len': 31}, 'xla', 'max_len=31: the training step of cuDNN needs even'),
    ('cpu', None, {}, 'xla', 'cuDNN flash attention needs an NVIDIA GPU, the target is cpu'),
    ('tpu', None, {}, 'xla', 'the target is tpu'),
    ('rocm', None, {}, 'xla', 'the target is rocm'),
])
def test_auto_resolves_to_cudnn_where_cudnn_takes_the_config(platform, capability, changes, impl,
                                                              why):
    config = _config(**changes)
    assert config.attention_impl == 'auto'  # the configs' default
    got, reason = attention_choice.resolve_attention_impl(config, platform, capability)
    assert (got, why in reason) == (impl, True), reason
    assert '\n' not in reason


def test_a_named_kernel_is_kept_or_refused_in_one_line():
    assert attention_choice.resolve_attention_impl(_config(attention_impl='xla'), 'gpu') == (
        'xla', 'as configured')
    assert attention_choice.resolve_attention_impl(
        _config(attention_impl='cudnn'), 'gpu', (9, 0))[0] == 'cudnn'
    refused = {  # (config changes, platform, capability): the error
        (('attention_impl', 'cudnn'), ('dtype', 'float32')): '--config.attention_impl=cudnn: '
        'dtype=float32: cuDNN flash attention takes bfloat16 or float16 (use auto or xla)',
        (('attention_impl', 'cudnn'), ('d_model', 1024)): '--config.attention_impl=cudnn: head '
        'dim 256 (d_model=1024 / num_heads=4): cuDNN takes multiples of 8 up to 128 on a CPU host '
        'compiling ahead of time (use auto or xla)',
        (('attention_impl', 'splash'),): '--config.attention_impl=splash: splash attention runs '
        'on TPU only, the target is gpu (use auto, xla, dot_product)',
    }
    for changes, line in refused.items():
        with pytest.raises(ValueError) as e:
            attention_choice.resolve_attention_impl(_config(**dict(changes)), 'gpu')
        assert str(e.value) == line
    with pytest.raises(ValueError, match=r"attention_impl='auto' names no kernel"):
        TransformerConfig(vocab_size=8, attention_impl='auto')
    # A library caller's from_config takes this process's kernel (the tests' CPU: xla).
    assert TransformerConfig.from_config(_config()).attention_impl == 'xla'


def test_the_entry_points_print_the_choice_and_a_tpu_dry_run_resolves_for_tpu(capsys):
    config = _config()
    cli.check_platform(config, 'gpu', 'train.py')
    assert config.attention_impl == 'cudnn'
    assert capsys.readouterr().out.startswith(
        'train.py: attention_impl=auto -> cudnn (cuDNN flash attention: bfloat16, head dim 8;')
    config = _config()
    line = aot.check_kernel(config, aot.parse_slice('v5e-8'))
    assert (config.attention_impl, line) == ('xla', 'attention_impl=auto -> xla (cuDNN flash '
                                             'attention needs an NVIDIA GPU, the target is tpu)')


# Attention shapes [B, L, H, K] and whether jax's cuDNN path traces them (its checks run when the
# primitive is bound, so jax.eval_shape asks them without a GPU or a compile).
@pytest.mark.parametrize('dtype, head_dim, length, training', [
    ('bfloat16', 8, 32, True), ('float32', 8, 32, True), ('bfloat16', 12, 32, False),
    ('bfloat16', 128, 32, False), ('bfloat16', 136, 32, False), ('bfloat16', 8, 31, True),
    ('bfloat16', 8, 31, False)])
def test_the_rules_agree_with_jax_cudnn_checks(dtype, head_dim, length, training):
    def loss(q, k, v, valid, segment):
        mask = make_attention_mask('cudnn', valid, valid, segment if training else None,
                                   segment if training else None, causal=True)
        out = dot_product_attention(q, k, v, mask, scale=0.5, impl='cudnn')
        return out.astype(jnp.float32).sum()

    x = jax.ShapeDtypeStruct((2, length, 2, head_dim), jnp.dtype(dtype))
    ids = jax.ShapeDtypeStruct((2, length), jnp.int32)
    fn = jax.grad(loss, argnums=(0, 1, 2)) if training else loss
    try:
        jax.eval_shape(fn, x, x, x, jax.ShapeDtypeStruct((2, length), bool), ids)
        jax_error = None
    except (ValueError, NotImplementedError) as e:
        jax_error = str(e)
    # The config whose training step (or, with training False, evaluation) has these shapes.
    config = _config(dtype=dtype, d_model=2 * head_dim, num_heads=2,
                     max_len=length if training else 32)
    problem = attention_choice.cudnn_problem(config, None)  # traced on this CPU host
    assert (problem is None) == (jax_error is None), (problem, jax_error)


# ----------------------------------------------------------------------------------------------
# Compiled for one H100 on this CPU


def _h100_mesh():
    with open(H100) as f:
        topology = topologies.get_topology_desc(platform='cuda', topology='1x1x1',
                                                target_config=f.read())
    return sharding.make_mesh((1, 1, 1), devices=topology.devices)


def _cudnn_calls(text: str) -> tuple[dict, int]:
    """({custom-call target: count}, how many of them run inside while loops)."""
    module = hlo.parse(text)
    loop_bodies = {name for instructions in module.computations.values()
                   for i in instructions if i.opcode == 'while'
                   for role, name in i.called if role == 'body'}
    targets, in_loops = {}, 0
    for name, instructions in module.computations.items():
        for i in instructions:
            m = CUDNN_CALL.search(i.attributes)
            if i.opcode == 'custom-call' and m:
                targets[m.group(1)] = targets.get(m.group(1), 0) + 1
                in_loops += name in loop_bodies or _called_from(module, name, loop_bodies)
    return targets, in_loops


def _called_from(module, computation: str, roots: set) -> bool:
    """Whether `computation` is reached from one of the `roots` computations."""
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name == computation:
            return True
        if name in seen:
            continue
        seen.add(name)
        todo += [c for i in module.computations.get(name, ()) for _, c in i.called]
    return False


@pytest.fixture(scope='module')
def h100_programs():
    """The tiny config (one layer a stack) resolved for an H100 and compiled: train step and beam
    search; and the float32 config's train step lowered (its kernel: XLA's)."""
    mesh = _h100_mesh()
    programs = {}
    for dtype in ('bfloat16', 'float32'):
        config = _config(dtype=dtype, num_encoder_layers=1, num_decoder_layers=1,
                         mesh_shape=(1, 1, 1))
        impl, reason = attention_choice.resolve_attention_impl(config, 'gpu')
        config.attention_impl = impl
        tx = optim.make_optimizer(config)
        state = train_lib.abstract_state(config, mesh, tx)
        step = train_lib.jit_train_step(train_lib.StepConfig.from_config(config), tx,
                                        jax.tree_util.tree_map(lambda x: x.sharding, state), mesh)
        lowered = step.lower(state, aot.abstract_batch(config, mesh))  # rows with segment ids
        if impl == 'xla':
            programs[dtype] = dict(impl=impl, reason=reason, train_lowered=lowered.as_text())
            continue
        predict = predict_lib.config_predict_fn(config, TransformerConfig.from_config(config),
                                                num_valid_ids=config.vocab_size, mesh=mesh)
        sources = jax.ShapeDtypeStruct((config.eval_batch_size, config.max_eval_len), jnp.int32,
                                       sharding=sharding.decode_sharding(mesh))
        programs[dtype] = dict(
            impl=impl, reason=reason, train=lowered.compile().as_text(),
            predict=predict.lower(state.params, sources).compile().as_text())
    return programs


@pytest.mark.xdist_group('gpu_kernels')
def test_auto_compiles_cudnn_into_the_train_step_and_the_search_encoder(h100_programs):
    bf16 = h100_programs['bfloat16']
    assert bf16['impl'] == 'cudnn'
    # Training rows carry segment ids: cuDNN with the mask as a bias, forward and backward, for
    # each attention (encoder self, decoder self and cross), none of them in a loop.
    assert _cudnn_calls(bf16['train']) == (
        {'__cudnn$fmhaScaleBiasSoftmax': 3, '__cudnn$fmhaScaleBiasSoftmaxBackward': 3}, 0)
    # Beam search: the encoder's self-attention once, by lengths; the cached steps inside the
    # search loop run XLA's softmax (none there).
    assert _cudnn_calls(bf16['predict']) == ({'__cudnn$fmhaSoftmax': 1}, 0)


@pytest.mark.xdist_group('gpu_kernels')
def test_auto_falls_back_to_xla_with_its_reason_where_cudnn_refuses(h100_programs):
    f32 = h100_programs['float32']
    assert (f32['impl'], f32['reason']) == (
        'xla', 'not cuDNN: dtype=float32: cuDNN flash attention takes bfloat16 or float16')
    assert '__cudnn' not in f32['train_lowered'] and 'stablehlo.dot_general' in f32[
        'train_lowered']
