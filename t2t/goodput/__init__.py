"""The goodput ledger: where each training attempt's wall time goes, written to WORKDIR/goodput/.

Every call of `loop.train_and_evaluate` is an attempt (a restart after a kill, a preemption or an
error is the next one). Its `Ledger` splits the attempt's time into phases, one at a time, with a
clock read at each switch, from the start of the process to the attempt's end:

  startup    the process start (interpreter, imports, jax, jax.distributed) up to the ledger
  setup      mesh, run record, model and optimizer state, evaluation data, jitted functions
  data       preparing the training data (tokenizer, packed rows)
  restore    reading the newest good checkpoint
  compile    the first call of the train step and of the eval step (trace, lower, compile or load
             from the persistent compilation cache, dispatch)
  train      training steps: dispatch, the device's step time, logging
  data_wait  fetching the next batch and putting it on the devices
  checkpoint the blocking part of saves (the state copied to host memory, the wait for the
             previous save) and the wait for the last save at the end
  eval       evaluation (eval loss and BLEU)
  profile    starting and writing a profile (t2t/run/profiling.py; the traced steps are 'train')
  logging    writing metrics (the console, TensorBoard, metrics.jsonl): the loop's wait for the
             workdir's storage, which a bucket outage makes long

Records are JSON lines in WORKDIR/goodput/attempt-<UTC start>-p<process>.jsonl, appended through
the workdir layer: a start record (train.py writes it before jax starts; with the launcher's count
of the attempt from $T2T_ATTEMPT, so that the report counts an attempt killed even before that),
a slice when the ledger begins, then a slice at each log step, checkpoint save and evaluation
(the seconds of each phase since the previous slice and the step reached), findings of the
watchdog as they come, and an end record with the exit cause. A killed attempt has no end record:
its last slice is where its account stops. Per step nothing but a clock read and a histogram
count happens (step times in 2% buckets: median, p90 and max per attempt).

`python -m t2t.goodput WORKDIR` reports over all attempts (t2t/goodput/report.py; definitions in
docs/goodput.md). Only process 0 writes unless config.goodput_all_processes.
"""

from t2t.goodput.ledger import (
                                DIRNAME,
                                PHASES,
                                Ledger,
                                bucket,
                                bucket_value,
                                note_startup,
                                open_attempt,
                                read_attempts,
)

__all__ = ['DIRNAME', 'PHASES', 'Ledger', 'bucket', 'bucket_value', 'note_startup',
           'open_attempt', 'read_attempts']
