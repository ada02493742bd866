"""scripts/mutants.py's mutants still find their text: a change that moves or rewrites a mutated
line fails here, in make test, instead of silencing the mutant (the mutants' runs are not in it)."""

import os
import sys

import pytest

from tests.helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, 'scripts'))
import mutants  # noqa: E402


@pytest.mark.parametrize('mutant', mutants.MUTANTS, ids=lambda m: m.name)
def test_each_mutant_changes_one_place_of_its_function_into_valid_python(mutant):
    path, text = mutants.mutate(ROOT, mutant)
    with open(path, encoding='utf-8') as f:
        original = f.read()
    assert text != original
    compile(text, path, 'exec')
    assert mutant.new.strip() in text


def test_a_moved_file_keeps_its_mutants_and_a_rewritten_line_is_stale(tmp_path):
    repo = tmp_path / 'repo'
    (repo / 't2t' / 'core').mkdir(parents=True)
    (repo / 't2t' / 'core' / 'optim.py').write_text(
        'def make_optimizer(config):\n    return adam(b1=0.9,\n'
        '                b2=config.adam_b2)\n')
    mutant = next(m for m in mutants.MUTANTS if m.name == 'adam_beta2')
    path, text = mutants.mutate(str(repo), mutant)
    assert path.endswith('t2t/core/optim.py') and 'b2=0.999' in text
    (repo / 't2t' / 'core' / 'optim.py').write_text('def make_optimizer(config):\n    return 1\n')
    with pytest.raises(LookupError, match='occurs 0 times in optim:make_optimizer'):
        mutants.mutate(str(repo), mutant)
