"""Data preparation at WMT size: `python -m t2t.data` on a synthetic corpus of N pairs.

    python bench/data_prep.py --pairs=1000000,4500000
    python bench/data_prep.py --pairs=36000000          # EN-FR size: needs the machine to itself

For each N: writes a TSV of N lines under --dir, each joining 1-3 random real pairs of the embedded
corpus (Debian trans-de-en, English -> German), so lengths and vocabulary look like WMT's (about
23 tokens a side); then

1. `python -m t2t.data --config=configs/wmt14_ende_base.py` with dataset=tsv on it, in a fresh
   data_dir (vocabulary of --vocab_size from --tokenizer_sentences sentences, max_len --max_len):
   wall time and peak RSS of the whole process tree (sampled every 0.25 s), and the stages it
   reports (vocabulary sample, vocabulary training, tokenize+pack, assemble);
2. the same with max_len - 1: packing alone, from the cached token ids;
3. the limit: `SentencePieceProcessor.encode` (the vocabulary of step 1, all cores) over the
   corpus's sentences, timing the encode calls only (the file is read and split outside the
   clock), on the first --limit_pairs pairs.

Prints one `RESULT {json}` line per N and a markdown table. Big corpora are deleted afterwards
unless --keep.
"""

import json
import os
import re
import resource
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from t2t.data import embedded, prepare, progress  # noqa: E402

_PAIRS = flags.DEFINE_list('pairs', ['1000000', '4500000'], 'corpus sizes (pairs)')
_DIR = flags.DEFINE_string('dir', '/tmp/t2t-data-prep', 'corpora and data_dirs go here')
_VOCAB = flags.DEFINE_integer('vocab_size', 32000, 'vocabulary size')
_SENTENCES = flags.DEFINE_integer('tokenizer_sentences', 1_000_000, 'vocabulary sample')
_MAX_LEN = flags.DEFINE_integer('max_len', 256, 'packed row length')
_LIMIT = flags.DEFINE_integer('limit_pairs', 2_000_000, 'pairs the limit is measured on')
_KEEP = flags.DEFINE_bool('keep', False, 'keep corpora and data_dirs')
_CONFIG = 'configs/wmt14_ende_base.py'
_BLOCK = 100_000


def write_corpus(path: str, n: int, pairs: list[tuple[str, str]], seed: int = 0) -> None:
    """n lines `english<TAB>german`, each 1-3 random (german, english) pairs joined."""
    rng = np.random.default_rng(seed)
    de, en = [p[0] for p in pairs], [p[1] for p in pairs]
    with open(path + '.tmp', 'w', encoding='utf-8') as f:
        for start in range(0, n, _BLOCK):
            m = min(_BLOCK, n - start)
            counts = rng.integers(1, 4, m).tolist()
            picks = rng.integers(0, len(pairs), (m, 3)).tolist()
            f.write(''.join(' '.join(en[j] for j in p[:k]) + '\t' + ' '.join(de[j] for j in p[:k])
                            + '\n' for p, k in zip(picks, counts, strict=True)))
    os.replace(path + '.tmp', path)


_STAGES = {
    'sample': r'train: vocabulary sample: [\d,]+ pairs in (?P<s>[\d.]+) s .*peak RSS '
              r'(?P<gb>[\d.]+)',
    'vocab': r'train: vocabulary training .*: (?P<s>[\d.]+) s, peak RSS (?P<gb>[\d.]+)',
    'tokpack': r'train: tokenize\+pack: (?P<n>[\d,]+) pairs in (?P<s>[\d.]+) s .*peak RSS '
               r'(?P<gb>[\d.]+) .*read\+tokenize (?P<tok_s>[\d.]+) s, (?P<tok_cpu>[\d.]+) CPU s; '
               r'cached ids loaded (?P<load_s>[\d.]+) s, (?P<load_cpu>[\d.]+) CPU s; '
               r'packing (?P<pack_s>[\d.]+) s, (?P<pack_cpu>[\d.]+) CPU s',
    'assemble': r'train: assemble: (?P<s>[\d.]+) s, peak RSS (?P<gb>[\d.]+)',
}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_prepare(args: list[str]) -> dict:
    """Runs python -m t2t.data: wall s, CPU s and peak RSS (GB) of its process tree, and the
    stages it printed."""
    start, cpu = time.perf_counter(), _children_cpu()
    proc = subprocess.Popen([sys.executable, '-m', 't2t.data', f'--config={_CONFIG}', *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = [0]

    def sample():
        while proc.poll() is None:
            peak[0] = max(peak[0], progress.tree_rss(proc.pid))
            time.sleep(0.25)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    lines = []
    for line in proc.stdout:
        print('  | ' + line.rstrip(), flush=True)
        lines.append(line.strip())
    proc.wait()
    sampler.join()
    if proc.returncode:
        raise RuntimeError(f'python -m t2t.data failed ({proc.returncode})')
    out = {'wall_s': time.perf_counter() - start, 'cpu_s': _children_cpu() - cpu,
           'peak_gb': peak[0] / 1e9}
    for name, pattern in _STAGES.items():
        match = next((m for m in map(re.compile(pattern).match, lines) if m), None)
        if match:
            out[name] = {k: float(v.replace(',', '')) for k, v in match.groupdict().items()}
    return out


def encode_limit(corpus: str, model: str, pairs: int) -> dict:
    """sentencepiece's own encoding of both sides of the first `pairs` pairs, all cores."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=model)
    threads, seconds, cpu, done = prepare.cores(), 0.0, 0.0, 0
    with open(corpus, encoding='utf-8') as f:
        while done < pairs:
            lines = [line for _, line in zip(range(min(_BLOCK, pairs - done)), f, strict=False)]
            if not lines:
                break
            sides = [line.rstrip('\n').split('\t') for line in lines]
            src, tgt = [s for s, _ in sides], [t for _, t in sides]
            start, start_cpu = time.perf_counter(), time.process_time()
            sp.encode(src, num_threads=threads)
            sp.encode(tgt, num_threads=threads)
            seconds += time.perf_counter() - start
            cpu += time.process_time() - start_cpu  # all of this process's threads
            done += len(lines)
    return {'pairs': done, 'seconds': seconds, 'cpu_s': cpu, 'pairs_s': done / seconds,
            'pairs_cpu_s': done / cpu, 'threads': threads}


def bench(n: int, real: list[tuple[str, str]], held_out: str) -> dict:
    corpus = os.path.join(_DIR.value, f'corpus-{n}.tsv')
    if not os.path.exists(corpus):
        start = time.perf_counter()
        write_corpus(corpus, n, real)
        print(f'wrote {corpus} ({os.path.getsize(corpus) / 1e9:.2f} GB) in '
              f'{time.perf_counter() - start:.0f} s', flush=True)
    data_dir = os.path.join(_DIR.value, f'data-{n}')
    shutil.rmtree(data_dir, ignore_errors=True)
    args = ['--config.dataset=tsv', f'--config.data_dir={data_dir}',
            f'--config.tsv_files.train={corpus}', f'--config.tsv_files.validation={held_out}',
            f'--config.tsv_files.test={held_out}', f'--config.vocab_size={_VOCAB.value}',
            f'--config.tokenizer_sentences={_SENTENCES.value}']
    full = run_prepare([*args, f'--config.max_len={_MAX_LEN.value}'])
    repack = run_prepare([*args, f'--config.max_len={_MAX_LEN.value - 1}'])
    vocab_dir = os.path.join(data_dir, 'vocab')
    model = os.path.join(vocab_dir, next(f for f in os.listdir(vocab_dir) if f.endswith('.model')))
    limit = encode_limit(corpus, model, min(n, _LIMIT.value))
    tokpack, pack = full['tokpack'], repack['tokpack']
    tokpack_cpu = max(tokpack['tok_cpu'] + tokpack['pack_cpu'], 1e-3)  # the workers' CPU s
    tokpack['s'], pack['s'] = max(tokpack['s'], 1e-3), max(pack['s'], 1e-3)  # toy sizes
    result = {
        'pairs': n, 'corpus_gb': os.path.getsize(corpus) / 1e9, 'vocab_size': _VOCAB.value,
        'tokenizer_sentences': _SENTENCES.value, 'max_len': _MAX_LEN.value,
        'workers': prepare.default_workers(), 'wall_s': full['wall_s'], 'cpu_s': full['cpu_s'],
        'peak_gb': full['peak_gb'], 'sample_s': full['sample']['s'],
        'vocab_s': full['vocab']['s'], 'vocab_peak_gb': full['vocab']['gb'],
        'tokpack_s': tokpack['s'], 'tokpack_pairs_s': n / tokpack['s'],
        'tokpack_cpu_s': tokpack_cpu, 'tokpack_pairs_cpu_s': n / tokpack_cpu,
        'tokenize_cpu_s': tokpack['tok_cpu'], 'tokpack_peak_gb': tokpack['gb'],
        'assemble_s': full['assemble']['s'],
        'pack_s': pack['s'], 'pack_pairs_s': n / pack['s'],
        'pack_cpu_s': pack['load_cpu'] + pack['pack_cpu'], 'pack_peak_gb': pack['gb'],
        'repack_tokenize_cpu_s': pack['tok_cpu'], 'repack_wall_s': repack['wall_s'],
        'limit_pairs_s': limit['pairs_s'], 'limit_pairs_cpu_s': limit['pairs_cpu_s'],
        'limit_pairs': limit['pairs'], 'limit_threads': limit['threads'],
        'ratio_wall': n / tokpack['s'] / limit['pairs_s'],
        'ratio_cpu': n / tokpack_cpu / limit['pairs_cpu_s'],
        'load_avg': os.getloadavg()[0],
    }
    print('RESULT ' + json.dumps(result), flush=True)
    if not _KEEP.value:
        shutil.rmtree(data_dir, ignore_errors=True)
        os.remove(corpus)
    return result


def main(argv):
    del argv
    os.makedirs(_DIR.value, exist_ok=True)
    splits = embedded.read_corpus(embedded.corpus_file(os.path.join(_DIR.value, 'ding')))
    held_out = os.path.join(_DIR.value, 'held_out.tsv')
    with open(held_out, 'w', encoding='utf-8') as f:
        f.write(''.join(f'{en}\t{de}\n' for de, en in splits['validation']))
    results = [bench(int(n), splits['train'], held_out) for n in _PAIRS.value]
    print('| pairs | wall (CPU) | peak RSS | vocab sample | vocab training | tokenize+pack '
          '(workers\' CPU) | pack alone, new max_len | sentencepiece encode alone (limit) | '
          'ratio wall / CPU |')
    print('|---|---|---|---|---|---|---|---|---|')
    for r in results:
        print(f'| {r["pairs"]:,} | {r["wall_s"]:.0f} s ({r["cpu_s"]:.0f} CPU s) | '
              f'{r["peak_gb"]:.2f} GB | {r["sample_s"]:.1f} s | {r["vocab_s"]:.0f} s '
              f'({r["vocab_peak_gb"]:.2f} GB) | {r["tokpack_s"]:.0f} s: '
              f'{r["tokpack_pairs_s"]:,.0f} pairs/s ({r["tokpack_pairs_cpu_s"]:,.0f} per CPU s), '
              f'{r["tokpack_peak_gb"]:.2f} GB | {r["pack_s"]:.1f} s: '
              f'{r["pack_pairs_s"]:,.0f} pairs/s, {r["pack_peak_gb"]:.2f} GB | '
              f'{r["limit_pairs_s"]:,.0f} pairs/s ({r["limit_pairs_cpu_s"]:,.0f} per CPU s, '
              f'{r["limit_threads"]} threads) | {r["ratio_wall"]:.2f} / {r["ratio_cpu"]:.2f} |',
              flush=True)

if __name__ == '__main__':
    app.run(main)
