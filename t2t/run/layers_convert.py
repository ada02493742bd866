"""Parameter trees (and whole train states) between unrolled and scanned layers.

Unrolled (scan_layers=False) parameters hold one subtree per layer: encoder_0 ... encoder_{N-1},
decoder_0 ... decoder_{M-1}. Scanned (scan_layers=True) ones hold one subtree per stack,
encoder_layers and decoder_layers, whose leaves carry a leading axis of N (M) layers, layer i at
index i. Everything else (embeddings, final norms) is the same in both.

    scanned = to_scanned(state)      # a TrainState, params, or Adam's mu / nu: any pytree
    unrolled = to_unrolled(scanned)  # the inverse
    params = to_layout(params, scan_layers=model_config.scan_layers)   # whichever is needed

Every dict in the tree that holds layer subtrees is converted, so a TrainState converts its
parameters and the optimizer's moments alike; other leaves pass through unchanged.

A checkpoint's parameters, for evaluate.py with a config of the other layout:

    python -m t2t.run.layers_convert --workdir=RUN --out=RUN_scanned --to=scanned [--step=N]

writes checkpoint N (default: the latest) of RUN as a parameters-only checkpoint of RUN_scanned
(the format of averaged checkpoints), readable by `checkpoint_read.restore_params` and evaluate.py.
"""

from __future__ import annotations

import argparse
import re
import sys

import jax
import numpy as np

STACKS = ('encoder', 'decoder')
_UNROLLED = re.compile(r'^(encoder|decoder)_(\d+)$')


def _is_unrolled(x) -> bool:
    return isinstance(x, dict) and any(_UNROLLED.match(str(k)) for k in x)


def _is_scanned(x) -> bool:
    return isinstance(x, dict) and any(f'{s}_layers' in x for s in STACKS)


def _stack(d: dict) -> dict:
    out = {k: v for k, v in d.items() if not _UNROLLED.match(str(k))}
    for stack in STACKS:
        indices = sorted(int(m.group(2)) for k in d if (m := _UNROLLED.match(str(k)))
                         and m.group(1) == stack)
        if not indices:
            continue
        if indices != list(range(len(indices))):
            raise ValueError(f'{stack} layers {indices} are not numbered 0..{len(indices) - 1}')
        layers = [d[f'{stack}_{i}'] for i in indices]
        out[f'{stack}_layers'] = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *layers)
    return out


def _unstack(d: dict) -> dict:
    out = {k: v for k, v in d.items() if k not in {f'{s}_layers' for s in STACKS}}
    for stack in STACKS:
        stacked = d.get(f'{stack}_layers')
        if stacked is None:
            continue
        sizes = {np.shape(x)[0] for x in jax.tree_util.tree_leaves(stacked)}
        if len(sizes) != 1:
            raise ValueError(f'{stack}_layers leaves disagree on the number of layers: {sizes}')
        for i in range(sizes.pop()):
            out[f'{stack}_{i}'] = jax.tree_util.tree_map(lambda x, i=i: np.asarray(x)[i], stacked)
    return out


def to_scanned(tree):
    """Stacks encoder_i / decoder_i subtrees into encoder_layers / decoder_layers (numpy)."""
    return jax.tree_util.tree_map(lambda x: _stack(x) if _is_unrolled(x) else x, tree,
                                  is_leaf=_is_unrolled)


def to_unrolled(tree):
    """Splits encoder_layers / decoder_layers into encoder_i / decoder_i subtrees (numpy)."""
    return jax.tree_util.tree_map(lambda x: _unstack(x) if _is_scanned(x) else x, tree,
                                  is_leaf=_is_scanned)


def to_layout(tree, *, scan_layers: bool):
    """The tree in the layout a model with this scan_layers setting expects (a no-op if it is)."""
    return to_scanned(tree) if scan_layers else to_unrolled(tree)


def convert_checkpoint(workdir: str, out: str, to: str, step: int | None = None) -> str:
    """Writes the params of checkpoint `step` of `workdir` in layout `to` ('scanned' or
    'unrolled') as a params-only checkpoint of `out`; returns its directory."""
    from t2t.run import checkpoint, checkpoint_read

    if to not in ('scanned', 'unrolled'):
        raise ValueError(f"to={to!r}; one of ('scanned', 'unrolled')")
    meta = checkpoint_read.read_metadata(workdir, step)  # step None: the latest
    step = int(meta['step'])
    params = checkpoint_read.restore_params(workdir, step)
    converted = to_layout(params, scan_layers=to == 'scanned')
    return str(checkpoint.write_averaged(
        out, converted, step, extra_metadata={'converted_from': str(workdir), 'layers': to}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description='Checkpoint parameters between unrolled and '
                                 'scanned layers (a params-only checkpoint, for evaluation).')
    ap.add_argument('--workdir', required=True)
    ap.add_argument('--out', required=True)
    ap.add_argument('--to', required=True, choices=('scanned', 'unrolled'))
    ap.add_argument('--step', type=int, default=None)
    args = ap.parse_args(argv)
    print(convert_checkpoint(args.workdir, args.out, args.to, args.step))
    return 0


if __name__ == '__main__':
    from t2t.infra import platforms

    platforms.skip_absent_tpu()
    sys.exit(main())
