"""Checkpoints round-trip bitwise, keep the newest K, average, and refuse corrupt data loudly."""

import os
import signal
import threading
import time

import flax.struct
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from configs.common import base_config
from t2t.infra.preemption import PreemptionFlag
from t2t.run import checkpoint as ckpt
from t2t.run import checkpoint_read


@flax.struct.dataclass
class State:
    step: jax.Array
    params: dict
    opt_state: optax.OptState
    rng: jax.Array


_TX = optax.adam(1e-3)


def make_state(seed=0, step=0):
    k = jax.random.key(seed)
    params = {
        'dense': {'kernel': jax.random.normal(k, (8, 4)), 'bias': jnp.arange(4.0)},
        'emb': jax.random.normal(jax.random.fold_in(k, 1), (16, 8)).astype(jnp.bfloat16),
    }
    return State(step=jnp.asarray(step, jnp.int32), params=params, opt_state=_TX.init(params),
                 rng=jax.random.fold_in(k, 2))


def config(keep=20):
    c = base_config()
    c.keep_checkpoints = keep
    return c


def data_iter():
    ds = grain.MapDataset.source(list(range(100))).shuffle(seed=0).batch(4).to_iter_dataset()
    return iter(ds)


def host(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def assert_bitwise_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = host(x), host(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        unsigned = np.dtype(f'u{x.dtype.itemsize}')  # compare bits, so NaNs and -0.0 count too
        np.testing.assert_array_equal(x.view(unsigned), y.view(unsigned))


def test_round_trip_bitwise_into_shardings(tmp_path):
    mesh = jax.make_mesh((8,), ('data',))
    state = make_state(seed=3, step=7)
    # One real Adam update so the moments are not zeros.
    grads = jax.tree.map(jnp.ones_like, state.params)
    updates, opt_state = _TX.update(grads, state.opt_state, state.params)
    state = state.replace(params=optax.apply_updates(state.params, updates), opt_state=opt_state)
    expected = jax.device_get(jax.tree.map(lambda x: x, state))

    manager = ckpt.make_manager(tmp_path, config())
    assert ckpt.latest_step(manager) is None
    assert ckpt.save(manager, 7, state)
    # Async save has copied to host: the caller may free (donate) the state at once.
    jax.tree.map(lambda x: x.delete(), state)
    ckpt.wait(manager)
    assert ckpt.all_steps(manager) == [7] and ckpt.latest_step(manager) == 7
    assert not ckpt.save(manager, 7, make_state())  # an existing step is skipped

    def target(x):
        spec = P('data') if x.ndim == 2 else P()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    abstract = jax.tree.map(target, jax.eval_shape(lambda: expected))
    restored = ckpt.restore(manager, 7, abstract)
    assert_bitwise_equal(restored, expected)
    kernel = restored.params['dense']['kernel']
    assert kernel.sharding == abstract.params['dense']['kernel'].sharding
    assert jax.dtypes.issubdtype(restored.rng.dtype, jax.dtypes.prng_key)

    meta = checkpoint_read.read_metadata(tmp_path)
    assert meta['step'] == 7 and meta['config']['keep_checkpoints'] == 20
    params = checkpoint_read.restore_params(tmp_path)  # no target: numpy on the host
    assert isinstance(params['emb'], np.ndarray) and params['emb'].dtype == jnp.bfloat16
    assert_bitwise_equal(params, expected.params)
    ckpt.close(manager)


def test_data_iterator_round_trip(tmp_path):
    state = make_state()
    manager = ckpt.make_manager(tmp_path, config(), async_=False)
    it = data_iter()
    for _ in range(3):
        next(it)
    ckpt.save(manager, 3, state, data_iter=it)
    expected = [next(it) for _ in range(5)]
    fresh = data_iter()
    abstract = jax.eval_shape(lambda: state)
    ckpt.restore(manager, 3, abstract, data_iter=fresh)
    got = [next(fresh) for _ in range(5)]
    for e, g in zip(expected, got, strict=True):
        np.testing.assert_array_equal(e, g)
    ckpt.save(manager, 4, state)  # saved without an iterator
    with pytest.raises(ckpt.CheckpointError, match='no data iterator'):
        ckpt.restore(manager, 4, abstract, data_iter=data_iter())


def test_keeps_last_k_and_averages(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path.parent)
    workdir = tmp_path.name  # a relative workdir, as `train.py --workdir=workdirs/x` gives
    manager = ckpt.make_manager(workdir, config(keep=2))
    states = {s: make_state(seed=s, step=s) for s in range(1, 5)}
    for s, state in states.items():
        assert ckpt.save(manager, s, state)  # each save waits for the previous async one
    ckpt.wait(manager)
    assert ckpt.all_steps(manager) == [3, 4]

    avg = checkpoint_read.average_checkpoints(workdir, [3, 4])
    want = jax.tree.map(
        lambda a, b: ((np.asarray(a, np.float32) + np.asarray(b, np.float32)) / 2).astype(a.dtype),
        states[3].params, states[4].params)
    assert_bitwise_equal(avg, want)

    out = tmp_path / 'averaged'
    step_dir = ckpt.write_averaged(out, avg, 4, config(), extra_metadata={'averaged': [3, 4]})
    assert step_dir.name == '4'
    assert_bitwise_equal(checkpoint_read.restore_params(out), want)
    assert checkpoint_read.read_metadata(out)['averaged'] == [3, 4]


def _flip_byte_in_largest_file(step_dir):
    files = [os.path.join(r, f) for r, _, fs in os.walk(step_dir / 'state') for f in fs]
    path = max(files, key=os.path.getsize)
    with open(path, 'r+b') as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0x10
        f.seek(0)
        f.write(data)


# After a failed read, orbax's tensorstore callback may hit its already closed event loop.
@pytest.mark.filterwarnings('ignore::pytest.PytestUnraisableExceptionWarning')
def test_corrupt_and_missing_checkpoints_raise(tmp_path):
    # A large array is stored raw by orbax: only the checksum notices a flipped bit.
    state = make_state().replace(params={'big': jnp.arange(64 * 64, dtype=jnp.float32)})
    state = state.replace(opt_state=_TX.init(state.params))
    manager = ckpt.make_manager(tmp_path, config(), async_=False)
    ckpt.save(manager, 5, state)
    _flip_byte_in_largest_file(tmp_path / 'checkpoints' / '5')
    step_dir = str(tmp_path / 'checkpoints' / '5')
    with pytest.raises(ckpt.CheckpointError, match=step_dir) as err:
        ckpt.restore(manager, 5, jax.eval_shape(lambda: state))
    assert '\n' not in str(err.value)
    with pytest.raises(ckpt.CheckpointError, match=step_dir):
        checkpoint_read.restore_params(tmp_path)

    # A damaged index is caught by orbax itself; the error still names the step.
    for root, _, files in os.walk(tmp_path / 'checkpoints' / '5' / 'state'):
        for f in files:
            if f == 'manifest.ocdbt':
                os.remove(os.path.join(root, f))
    with pytest.raises(ckpt.CheckpointError, match=step_dir) as err:
        checkpoint_read.restore_params(tmp_path, 5)
    assert '\n' not in str(err.value)

    with pytest.raises(ckpt.CheckpointError, match='no checkpoint for step 6'):
        ckpt.restore(manager, 6, jax.eval_shape(lambda: state))
    with pytest.raises(ckpt.CheckpointError, match='no checkpoint directory'):
        checkpoint_read.restore_params(tmp_path / 'missing')
    empty = ckpt.make_manager(tmp_path / 'empty', config())
    with pytest.raises(ckpt.CheckpointError, match='no checkpoints in'):
        ckpt.restore(empty, None, jax.eval_shape(lambda: state))


def test_preemption_flag_catches_sigterm():
    previous = signal.getsignal(signal.SIGTERM)
    with PreemptionFlag() as flag:
        assert not flag.any_process()
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.is_set() and flag.any_process()
    assert signal.getsignal(signal.SIGTERM) is previous


def test_a_checkpoint_of_another_config_is_an_error_not_corruption(tmp_path):
    manager = ckpt.make_manager(tmp_path, config(), async_=False)
    ckpt.save(manager, 1, make_state())
    other = make_state()
    other = other.replace(params={**other.params, 'dense': {'kernel': jnp.zeros((8, 5)),
                                                            'bias': jnp.zeros(4)}})
    abstract = jax.eval_shape(lambda: other)
    with pytest.raises(ckpt.CheckpointError, match=r'does not fit the state of this config: '
                       r'params/dense/kernel is \(8, 4\), the config wants \(8, 5\)') as error:
        ckpt.restore_newest_good(manager, lambda step: ckpt.restore(manager, step, abstract))
    assert not isinstance(error.value, ckpt.CorruptCheckpointError)
    assert ckpt.all_steps(manager) == [1] and not (tmp_path / 'corrupt').exists()  # not moved


# The state classes a run had before train_lib.TrainState took optional fields: one per option.
@flax.struct.dataclass
class EmaState(State):
    ema: dict


@flax.struct.dataclass
class GuardState(State):
    guard: dict


@flax.struct.dataclass
class EmaGuardState(EmaState):
    guard: dict


@pytest.mark.parametrize('old_class', [State, EmaState, GuardState, EmaGuardState])
def test_checkpoints_of_the_former_state_classes_restore_into_the_one_train_state(tmp_path,
                                                                                  old_class):
    from t2t.train_lib import TrainState, init_guard

    base = make_state(seed=5, step=3)
    fields = {f: getattr(base, f) for f in ('step', 'params', 'opt_state', 'rng')}
    extra = {}
    if 'ema' in old_class.__dataclass_fields__:
        extra['ema'] = jax.tree.map(lambda x: x + 1, base.params)
    if 'guard' in old_class.__dataclass_fields__:
        extra['guard'] = jax.tree.map(lambda x: x + 2, init_guard(4))
    old = jax.device_get(old_class(**fields, **extra))
    manager = ckpt.make_manager(tmp_path / 'old', config(), async_=False)
    ckpt.save(manager, 3, old)
    new = TrainState(**fields, **extra)  # the fields of an option that is off stay None
    restored = ckpt.restore(manager, 3, jax.eval_shape(lambda: new))
    assert type(restored) is TrainState
    assert (restored.ema is None, restored.guard is None) == ('ema' not in extra,
                                                              'guard' not in extra)
    assert_bitwise_equal(restored, new)
    # The one class writes the layout the former one wrote: the same names, arrays and bits.
    manager_new = ckpt.make_manager(tmp_path / 'new', config(), async_=False)
    ckpt.save(manager_new, 3, new)
    for m in (manager, manager_new):
        ckpt.close(m)
    old_meta, new_meta = (checkpoint_read.read_metadata(tmp_path / n) for n in ('old', 'new'))
    assert old_meta['checksums'] == new_meta['checksums']
    stored = [checkpoint_read.restore_params(tmp_path / n) for n in ('old', 'new')]
    assert_bitwise_equal(*stored)


def test_a_state_with_nan_is_refused(tmp_path):
    manager = ckpt.make_manager(tmp_path, config(), async_=False)
    state = make_state()
    state = state.replace(params={**state.params, 'emb': state.params['emb'].at[3, 1].set(jnp.inf)})
    with pytest.raises(ckpt.CheckpointError, match='step 2: refusing to save a state with NaN or '
                                                   'inf in params/emb'):
        ckpt.save(manager, 2, state)
    assert ckpt.all_steps(manager) == [] and checkpoint_read.finished_steps(tmp_path) == []


@pytest.mark.parametrize('written_with', [True, False])
def test_attention_biases_of_a_checkpoint_restore_with_the_flag_that_names_them(tmp_path,
                                                                                written_with):
    """Checkpoints written before attention_bias existed have the biases (written_with=True):
    training and evaluation name the flag that restores them, in one line, before restoring;
    with it the parameters come back bitwise equal."""
    import types

    from t2t import optim, sharding, train_lib
    from t2t.eval import checkpoints as eval_checkpoints
    from t2t.model import TransformerConfig
    from tests.helpers import tiny_config

    written = tiny_config(attention_bias=written_with)
    other = tiny_config(attention_bias=not written_with)
    mesh = sharding.make_mesh(written.mesh_shape)
    tx = optim.make_optimizer(written)
    state, _ = train_lib.create_sharded_state(written, mesh, tx)
    manager = ckpt.make_manager(tmp_path, written, async_=False)
    ckpt.save(manager, 1, state)
    flag = f'run with --config.attention_bias={written_with}'

    # train.py's restore (t2t/train/loop.py): a CheckpointError, not corruption; nothing moved
    with pytest.raises(ckpt.CheckpointError) as error:
        ckpt.restore_newest_good(manager, lambda s: ckpt.restore(
            manager, s, train_lib.abstract_state(other, mesh, tx)))
    assert not isinstance(error.value, ckpt.CorruptCheckpointError)
    assert str(error.value).endswith(flag) and '\n' not in str(error.value), str(error.value)
    assert ckpt.all_steps(manager) == [1] and not (tmp_path / 'corrupt').exists()
    restored = ckpt.restore(manager, 1, train_lib.abstract_state(written, mesh, tx))
    assert_bitwise_equal(restored.params, jax.device_get(state.params))

    # evaluate.py's restore (t2t/eval/evaluation.py)
    params = eval_checkpoints.load_params(tmp_path, [1])
    tokenizer = types.SimpleNamespace(vocab_size=written.vocab_size)
    with pytest.raises(eval_checkpoints.EvalError) as error:
        eval_checkpoints.check_params(params, TransformerConfig.from_config(other), tokenizer,
                                      'step-1')
    assert str(error.value).endswith(flag) and '\n' not in str(error.value), str(error.value)
    eval_checkpoints.check_params(params, TransformerConfig.from_config(written), tokenizer,
                                  'step-1')
    assert_bitwise_equal(params, jax.device_get(state.params))
    ckpt.close(manager)


def test_a_save_whose_directory_creation_failed_leaves_no_thread_waiting(tmp_path, monkeypatch):
    """orbax leaves the writers of a save whose item directories could not be created waiting
    five minutes for that signal, holding the process's exit (seen after a bucket outage);
    `wait` raises the failure and releases them, and the next save works."""
    from orbax.checkpoint._src.futures import future
    from orbax.checkpoint._src.path import atomicity

    manager = ckpt.make_manager(tmp_path, config())
    assert ckpt.save(manager, 1, make_state(step=1))
    ckpt.wait(manager)
    create_paths = atomicity._create_paths

    async def unavailable(*args, **kwargs):
        raise ConnectionResetError('storage unavailable')

    monkeypatch.setattr(atomicity, '_create_paths', unavailable)
    ckpt.save(manager, 2, make_state(step=2))
    with pytest.raises(checkpoint_read.CheckpointError, match='checkpoints/2 failed'):
        ckpt.wait(manager)

    def waiting():
        return [t.name for t in threading.enumerate()
                if isinstance(t, future._SignalingThread) and t.is_alive()]

    deadline = time.monotonic() + 10  # released at once; orbax's own timeout is 300 s
    while waiting() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert waiting() == []
    monkeypatch.setattr(atomicity, '_create_paths', create_paths)
    assert ckpt.save(manager, 3, make_state(step=3))
    ckpt.wait(manager)
    assert ckpt.all_steps(manager) == [1, 3]
    ckpt.close(manager)
