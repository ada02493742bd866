"""Metric writers (stdout, TensorBoard, JSON lines) and model-FLOPs utilization.

`MetricWriter(DIR)` writes each call's scalars to three places:
  stdout           one line: `step 1200 | loss 3.214 | lr 0.000512 | ...`
  DIR/events.*     TensorBoard event files (tensorboardX, no TensorFlow)
  DIR/metrics.jsonl one JSON object per call, {"step": 1200, "loss": 3.214, ...}, appended and
                   flushed at once so a crash loses nothing. After a resume from an earlier
                   checkpoint a step may appear twice: the later line is the one that counts
                   (`read_jsonl` keeps it). Non-finite values are written as null (strict JSON).
Only the writer with enabled=True writes (pass enabled=jax.process_index() == 0).
"""

import json
import math
import os
import sys
from collections.abc import Mapping

import jax
import numpy as np

JSONL_NAME = 'metrics.jsonl'


def _to_float(value) -> float:
    return float(np.asarray(jax.device_get(value)))


def _format(value: float) -> str:
    return f'{value:.6g}'


class MetricWriter:
    def __init__(self, logdir, enabled: bool = True, tensorboard: bool = True, stream=None):
        self.logdir = os.fspath(logdir)
        self.enabled = enabled
        self._stream = stream
        self._jsonl = None
        self._tb = None
        if not enabled:
            return
        os.makedirs(self.logdir, exist_ok=True)
        self._jsonl = open(os.path.join(self.logdir, JSONL_NAME), 'a', encoding='utf-8')
        if tensorboard:
            from tensorboardX import SummaryWriter  # imported lazily: it pulls in protobuf

            self._tb = SummaryWriter(self.logdir)

    def write_scalars(self, step: int, scalars: Mapping[str, object]) -> None:
        """Writes `scalars` (numbers or 0-d arrays; None values are skipped) at `step`."""
        if not self.enabled:
            return
        step = int(step)
        values = {k: _to_float(v) for k, v in scalars.items() if v is not None}
        line = ' | '.join([f'step {step}'] + [f'{k} {_format(v)}' for k, v in values.items()])
        print(line, file=self._stream or sys.stdout, flush=True)
        record = {'step': step, **{k: v if math.isfinite(v) else None for k, v in values.items()}}
        self._jsonl.write(json.dumps(record) + '\n')
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> 'MetricWriter':
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_jsonl(path) -> list[dict]:
    """The records of a metrics.jsonl (a file or its directory), one per step, sorted by step.

    Lines of the same step are merged (training and evaluation scalars are written separately);
    where a key repeats, the later write wins (a resumed run rewrites steps after its checkpoint).
    A torn last line (crash mid-write) is ignored.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, JSONL_NAME)
    by_step = {}
    with open(path, encoding='utf-8') as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            by_step.setdefault(record['step'], {}).update(record)
    return [by_step[s] for s in sorted(by_step)]


# --- model FLOPs utilization ----------------------------------------------------------------------

# Dense bf16 peak FLOP/s per device from the vendors' datasheets (no sparsity), matched by
# substring of jax's device_kind, most specific first. fp32 training cannot reach these peaks.
_PEAK_FLOPS = (
    ('h100 pcie', 756e12),
    ('h100', 989e12),
    ('h200', 989e12),
    ('a100', 312e12),
    ('tpu v4', 275e12),
    ('tpu v5 lite', 197e12),  # v5e
    ('tpu v5e', 197e12),
    ('tpu v5p', 459e12),
    ('tpu v5', 459e12),  # v5p reports itself as 'TPU v5'
    ('tpu v6 lite', 918e12),  # v6e (Trillium)
    ('tpu v6e', 918e12),
)


def peak_flops_per_device(device_kind: str | None = None) -> float | None:
    """Datasheet peak of `device_kind` (default: the first jax device); None when unknown (CPU)."""
    if device_kind is None:
        device_kind = jax.devices()[0].device_kind
    kind = device_kind.lower()
    for name, flops in _PEAK_FLOPS:
        if name in kind:
            return flops
    return None


def mfu(
    flops_per_step: float,
    step_time_s: float,
    num_devices: int,
    peak_flops_per_device: float | None,
) -> float:
    """Achieved model FLOP/s over the peak of all devices; NaN when the peak is unknown."""
    if not peak_flops_per_device or step_time_s <= 0 or num_devices <= 0:
        return math.nan
    return flops_per_step / step_time_s / (num_devices * peak_flops_per_device)
