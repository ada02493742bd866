"""What a user runs prints t2t's lines, not its libraries' warnings: evaluate.py end to end."""

import os
import random
import re

from t2t import data, optim, sharding, train_lib
from t2t.run import checkpoint
from tests import toy_corpus
from tests.helpers import ROOT, run_script, tiny_config

# absl's line prefix: W1201 05:05:48.246602 139859538611072 checkpoint_manager.py:849]
ABSL_LINE = re.compile(r'^[WEF]\d{4} [\d:.]+ +\d+ (\S+\.py):\d+\]', re.M)
T2T_FILES = {f for _, _, files in os.walk(os.path.join(ROOT, 't2t')) for f in files}


def test_evaluate_prints_no_library_warnings(tmp_path):
    rng = random.Random(0)
    overrides = {'dataset': 'tsv', 'data_dir': str(tmp_path / 'data'), 'vocab_size': 400,
                 'tokenizer_sentences': 1000, 'max_eval_len': 32, 'eval_batch_size': 8,
                 'beam_size': 2, 'max_decode_len': 8, 'max_decode_extra': 4}
    config = tiny_config(**overrides)
    for split, n in (('train', 100), ('validation', 4), ('test', 6)):
        path = toy_corpus.write_tsv(tmp_path / f'{split}.tsv',
                                    [toy_corpus.sentence(rng, 2, 6) for _ in range(n)])
        config.tsv_files[split] = overrides[f'tsv_files.{split}'] = path
    data.get_tokenizer(config)  # prepared, as python -m t2t.data does
    mesh = sharding.make_mesh(config.mesh_shape)
    state, _ = train_lib.create_sharded_state(config, mesh, optim.make_optimizer(config))
    workdir = tmp_path / 'run'
    manager = checkpoint.make_manager(workdir, config, async_=False)
    checkpoint.save(manager, 1, state)
    checkpoint.close(manager)

    # tiny_config's shrunk keys too, so that the checkpoint fits evaluate.py's model
    flags = [f'--config.{k}={v}' for k, v in {'max_len': config.max_len, **overrides}.items()]
    proc = run_script('evaluate.py', '--config=configs/tiny.py', f'--workdir={workdir}', *flags)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert 'sacreBLEU' in proc.stdout and 'read only' not in proc.stderr
    # orbax printed 'Given directory is read only' twice before the scores; the only warnings
    # left are t2t's own (e.g. pipeline.py counting test sentences over max_eval_len)
    assert set(ABSL_LINE.findall(proc.stderr)) <= T2T_FILES, proc.stderr[-2000:]
    assert 'Warning:' not in proc.stderr, proc.stderr[-2000:]
