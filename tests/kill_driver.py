"""A tiny training run that interrupts itself at a chosen moment, for the kill-safety tests.

    python -m tests.kill_driver '{"corpus": {...}, "overrides": {...}, "workdir": "...",
                                  "action": "kill_in_save", "at": 6}'

actions (a real signal each time, at a moment chosen exactly instead of by chance):
  none          train to the end
  kill_in_save  SIGKILL while the checkpoint of step `at` is being written (its metadata item, in
                orbax's background commit: the step's temporary directory is half written)
  sigterm_in_eval  SIGTERM (a preemption notice) as the `at`-th evaluation of this run starts
Prints {"step": ..., "stopped_by": ...} when training returns. With "distributed" (coordinator,
num_processes, process_id) it is one process of a jax.distributed job.
"""

import json
import os
import pathlib
import signal
import sys


def _install(action: str, at: int) -> None:
    from t2t.train import loop

    if action == 'kill_in_save':
        import orbax.checkpoint as ocp

        original = ocp.JsonCheckpointHandler._save_fn

        async def save_fn(self, item, directory):
            if item.get('step') == at:
                os.kill(os.getpid(), signal.SIGKILL)
            return await original(self, item, directory)

        ocp.JsonCheckpointHandler._save_fn = save_fn
    elif action == 'sigterm_in_eval':
        original_eval, calls = loop.evaluate_loss, []

        def evaluate_loss(eval_fn, params, batches, mesh, num_batches):
            calls.append(1)

            def batches_then_signal():
                for i, batch in enumerate(batches):
                    if i == 0 and len(calls) == at:
                        os.kill(os.getpid(), signal.SIGTERM)
                    yield batch

            return original_eval(eval_fn, params, batches_then_signal(), mesh, num_batches)

        loop.evaluate_loss = evaluate_loss
    elif action != 'none':
        raise ValueError(f'unknown action {action!r}')


def main(spec: dict) -> None:
    if 'distributed' in spec:  # coordinator, num_processes, process_id
        import jax

        d = spec['distributed']
        jax.distributed.initialize(d['coordinator'], d['num_processes'], d['process_id'])
    from t2t.train import loop
    from tests.helpers import tiny_config

    _install(spec['action'], spec.get('at', 0))
    corpus = dict(spec['corpus'], root=pathlib.Path(spec['corpus']['root']))
    config = tiny_config(corpus, **spec['overrides'])
    if 'data_dir' in spec:  # a host-local data_dir
        config.data_dir = spec['data_dir']
    from t2t.run import compile_cache

    compile_cache.setup(config)  # as train.py does
    result = loop.train_and_evaluate(config, spec['workdir'])
    print(json.dumps({'step': result.step, 'stopped_by': result.stopped_by}), flush=True)


if __name__ == '__main__':
    main(json.loads(sys.argv[1]))
