"""Metric writers (stdout, TensorBoard, JSON lines) and model-FLOPs utilization.

`MetricWriter(DIR)` writes each call's scalars to three places:
  stdout           one line: `step 1200 | loss 3.214 | lr 0.000512 | ...`
  DIR/events.*     TensorBoard event files (tensorboardX, no TensorFlow)
  DIR/metrics.jsonl one JSON object per call, {"step": 1200, "loss": 3.214, ...}, appended and
                   flushed at once (after the event), so a crash loses at most the call in flight.
                   Non-finite values are written as null (strict JSON).
A run resumed from the checkpoint of step S passes start_step=S: the records and events of later
steps, written before the interruption, are removed first (each file rewritten to a new file that
replaces it atomically), and so are those at step S whose keys all start with one of
`redo_at_start` (values the resumed run writes again, e.g. a pending evaluation). The new event
file tells a running TensorBoard to purge steps > S (tensorboardX's purge_step: a SessionLog.START
event), so no step ever holds two values.
Only the writer with enabled=True writes (pass enabled=jax.process_index() == 0).

DIR may be a bucket URL (gs://...): every file goes through t2t/infra/workdir.py. A bucket cannot
append, so metrics.jsonl is kept in memory and its object rewritten whole, and the event file is
written by tensorboardX in a local staging directory and uploaded whole; both by the writer thread
of an uploads.Uploader (t2t/infra/uploads.py), so a call returns without waiting for the bucket:
the event first, then the record (a record in metrics.jsonl means its call is complete:
evaluate.py --watch relies on it). While the bucket fails the records stay in memory and are
written when it answers again, said once when that begins and once when it ends. A call waits only
when the process's write queue is full (storage_queue_mb), and ends the run when the bucket has
failed longer than storage_outage_limit_s (workdir.StorageError). `written(seconds)` waits for
every record so far; `close` waits up to its limit for the rest.
"""

import dataclasses
import functools
import json
import math
import os
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping

import jax
import numpy as np

from t2t.infra import uploads
from t2t.infra import workdir as wd

JSONL_NAME = 'metrics.jsonl'
EVENTS_GLOB = 'events.out.tfevents.*'


@functools.cache
def _tensorboardx():
    """The tensorboardX package, imported once and without torch: its writer module imports torch
    whenever it is installed (to accept torch tensors, which t2t never passes), and a torch import
    costs every process that writes metrics seconds of start-up. Where torch is already imported,
    as is. Its submodules are imported after this from sys.modules, torch-free."""
    if 'torch' in sys.modules:
        import tensorboardX
        return tensorboardX
    sys.modules['torch'] = None  # `import torch` raises ImportError, which tensorboardX expects
    try:
        import tensorboardX
    finally:
        del sys.modules['torch']
    return tensorboardX


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _to_float(value) -> float:
    return float(np.asarray(jax.device_get(value)))


def _format(value: float) -> str:
    return f'{value:.6g}'


class MetricWriter:
    def __init__(self, logdir, enabled: bool = True, tensorboard: bool = True, stream=None,
                 start_step: int | None = None, redo_at_start: tuple[str, ...] = (), sinks=()):
        """start_step: the step this run starts from (0 fresh, S resumed): later records go.
        sinks: more trackers (t2t/infra/trackers.py), each given the same scalars: log(step,
        values), close()."""
        self.logdir = wd.path(logdir)
        self.enabled = enabled
        self._sinks = list(sinks)
        self._stream = stream
        self._jsonl = None
        self._tb = None
        self._staging = None  # a local directory for the event file of a bucket logdir
        self._staged = {}  # bytes of each staged event file given to the uploader
        self._uploader = None  # a bucket logdir's writer thread
        self._bucket = wd.is_url(self.logdir)
        if not enabled:
            return
        wd.makedirs(self.logdir)
        if start_step is not None:
            truncate(self.logdir, start_step, redo_at_start)
        if self._bucket:
            self._uploader = uploads.Uploader('metrics', say=_stderr)
            self._jsonl_base = wd.read_bytes(self.logdir / JSONL_NAME) or b''
        else:
            self._jsonl = wd.Appender(self.logdir / JSONL_NAME)
        if tensorboard:
            SummaryWriter = _tensorboardx().SummaryWriter  # lazily: it pulls in protobuf
            if wd.is_url(self.logdir):
                self._staging = tempfile.mkdtemp(prefix='t2t-events-')
            # tensorboardX names files by the second and opens them with 'wb': the suffix keeps
            # a writer started within the same second from wiping the previous one's file.
            # purge_step hides the steps a running TensorBoard read before this (re)start.
            self._tb = SummaryWriter(
                self._staging or os.fspath(self.logdir),
                filename_suffix=f'.{time.time_ns()}.{os.getpid()}',
                purge_step=None if start_step is None else start_step + 1)

    def write_scalars(self, step: int, scalars: Mapping[str, object]) -> None:
        """Writes `scalars` (numbers or 0-d arrays; None values are skipped) at `step`."""
        if not self.enabled:
            return
        step = int(step)
        values = {k: _to_float(v) for k, v in scalars.items() if v is not None}
        line = ' | '.join([f'step {step}'] + [f'{k} {_format(v)}' for k, v in values.items()])
        print(line, file=self._stream or sys.stdout, flush=True)
        for sink in self._sinks:
            sink.log(step, values)
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        record = {'step': step, **{k: v if math.isfinite(v) else None for k, v in values.items()}}
        if not self._bucket:
            self._jsonl.append(json.dumps(record) + '\n')
            return
        self._stage_events()  # first: the uploader writes files in the order first given
        self._uploader.track(self.logdir / JSONL_NAME, self._jsonl_base)
        self._uploader.add(self.logdir / JSONL_NAME, (json.dumps(record) + '\n').encode())
        uploads.QUEUE.check()  # storage down past storage_outage_limit_s: the run ends
        uploads.QUEUE.make_room()  # waits only when the write queue is full

    def _stage_events(self) -> None:
        """Gives the uploader what tensorboardX appended to the staged event files."""
        for name in sorted(os.listdir(self._staging)) if self._staging else ():
            with open(os.path.join(self._staging, name), 'rb') as f:
                f.seek(self._staged.get(name, 0))
                new = f.read()
            self._staged[name] = self._staged.get(name, 0) + len(new)
            if new:
                self._uploader.add(self.logdir / name, new)

    def mark(self) -> dict | None:
        """The records so far, for `written` (None: a local logdir, always written)."""
        return None if self._uploader is None else self._uploader.mark()

    def written(self, seconds: float, mark: dict | None = None) -> bool:
        """Waits up to `seconds` for the records up to `mark` (default: all so far) to be in
        storage: True when they are (a local logdir always is)."""
        return self._uploader is None or self._uploader.wait(seconds, mark)

    def unwritten(self) -> dict[str, int]:
        """{object: bytes kept and not yet in the bucket}."""
        return {} if self._uploader is None else self._uploader.unwritten()

    def unwritten_records(self) -> int:
        """The records of metrics.jsonl kept and not yet in the bucket."""
        return 0 if self._uploader is None else \
            self._uploader.unwritten_lines(self.logdir / JSONL_NAME)

    def close(self, limit_s: float = 0.0, quiet: bool = False, upload: bool = True) -> None:
        """Closes the files; in a bucket, waits up to limit_s (at least the storage layer's
        retries) for the records not yet written (then workdir.StorageError naming them).
        quiet=True (a run ending on an error or a SIGTERM, whose steps after its last checkpoint
        are redone anyway): a few seconds, none while the bucket fails, and no error.
        upload=False (a run ending because its storage failed): no wait at all."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        while self._sinks:
            self._sinks.pop().close()
        try:
            if self._uploader is not None:
                self._stage_events()
                # the storage layer's retries at least (limit 0: a write is not retried further);
                # quiet, a moment while the storage answers, none once it fails
                wait_s = 0.0 if not upload or (quiet and uploads.QUEUE.down()) else \
                    5.0 if quiet else max(limit_s, wd.RETRY_BUDGET_S)
                began = time.monotonic()
                left = self._uploader.unwritten()
                if not self._uploader.close(wait_s) and upload and not quiet:
                    raise wd.StorageError(
                        f'writing the metrics to {self.logdir} failed for '
                        f'{time.monotonic() - began:.0f} s (storage_outage_limit_s): '
                        f'{", ".join(sorted(os.path.basename(p) for p in left))} not written')
        finally:
            if self._jsonl is not None:
                self._jsonl.close()
                self._jsonl = None
            if self._staging is not None:
                shutil.rmtree(self._staging, ignore_errors=True)
                self._staging = None

    def __enter__(self) -> 'MetricWriter':
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_jsonl(path) -> list[dict]:
    """The records of a metrics.jsonl (a file or its directory), one per step, sorted by step.

    Lines of the same step are merged (training and evaluation scalars are written separately);
    where a key repeats, the later write wins. A torn last line (crash mid-write) is ignored.
    """
    path = wd.path(path)
    if wd.is_dir(path):
        path = path / JSONL_NAME
    text = wd.read_text(path)
    if text is None:
        raise FileNotFoundError(f'{path} does not exist')
    by_step = {}
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        by_step.setdefault(record['step'], {}).update(record)
    return [by_step[s] for s in sorted(by_step)]


# --- truncation on resume ----------------------------------------------------------------------


def _kept(step: int, keys, last_step: int, redo: tuple[str, ...]) -> bool:
    if step == last_step and redo:
        return not all(key.startswith(redo) for key in keys)
    return step <= last_step


def _jsonl_lines_up_to(data: bytes, last_step: int, redo: tuple[str, ...]) -> Iterator[bytes]:
    for line in data.splitlines(keepends=True):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn line (crash mid-write)
        step = record.pop('step', 0)
        if _kept(step, record, last_step, redo):
            yield line if line.endswith(b'\n') else line + b'\n'


def _records(data: bytes) -> Iterator[bytes]:
    """The framed records of a TFRecord file's bytes (length, crc, data, crc), each raw.

    Stops at a torn record (crash mid-write) or a damaged length field.
    """
    _tensorboardx()
    from tensorboardX.record_writer import masked_crc32c

    offset = 0
    while offset + 12 <= len(data):
        header = data[offset:offset + 12]
        length, length_crc = struct.unpack('<QI', header)
        if masked_crc32c(header[:8]) != length_crc:
            return
        end = offset + 12 + length + 4
        if end > len(data):
            return
        yield data[offset:end]
        offset = end


def _event(record: bytes):
    _tensorboardx()
    from tensorboardX.proto.event_pb2 import Event

    return Event.FromString(record[12:-4])


def _event_records_up_to(data: bytes, last_step: int, redo: tuple[str, ...]) -> Iterator[bytes]:
    for record in _records(data):
        event = _event(record)
        # Keep the file header (file_version) and anything at or before the step.
        tags = [value.tag for value in event.summary.value]
        if event.HasField('file_version') or _kept(event.step, tags, last_step,
                                                   redo if tags else ()):
            yield record


def truncate(logdir, last_step: int, redo_at_last: tuple[str, ...] = ()) -> None:
    """Removes the records of steps > last_step from DIR/metrics.jsonl and DIR's event files,
    and those at last_step whose keys all start with one of `redo_at_last`."""
    logdir = wd.path(logdir)
    path = logdir / JSONL_NAME
    data = wd.read_bytes(path)
    if data is not None:
        wd.write_atomic(path, b''.join(_jsonl_lines_up_to(data, last_step, redo_at_last)))
    for events in wd.glob(logdir, EVENTS_GLOB):
        data = wd.read_bytes(events)
        wd.write_atomic(events, b''.join(_event_records_up_to(data, last_step, redo_at_last)))


def read_events(logdir) -> list[tuple[str, int, float]]:
    """(tag, step, value) of every scalar in DIR's event files, in file order (as written)."""
    out = []
    for path in wd.glob(wd.path(logdir), EVENTS_GLOB):
        for record in _records(wd.read_bytes(path)):
            event = _event(record)
            for value in event.summary.value:
                out.append((value.tag, int(event.step), float(value.simple_value)))
    return out


# --- model FLOPs utilization ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator's datasheet numbers, per jax device (a TPU chip, a GPU)."""

    name: str
    peak_bf16_flops: float  # dense bf16 FLOP/s (no sparsity); fp32 training cannot reach it
    hbm_bytes_per_s: float | None = None  # HBM bandwidth (None: not used here, not recorded)
    # The chips' own interconnect, both directions together: TPU ICI, GPU NVLink
    ici_bytes_per_s: float | None = None
    # float32 matmuls: GPUs run them as TF32 on tensor cores at jax's default precision
    peak_fp32_flops: float | None = None


# The one table of chips: MFU (here), the TPU roofline and XLA's estimate (t2t/aot) read it.
# GPUs from NVIDIA's datasheets (SXM unless named; dense, no sparsity): H100 989 TFLOPS bf16,
# 494 TF32, HBM3 3.35 TB/s, NVLink 900 GB/s; H200 the same compute, HBM3e 4.8 TB/s; A100 80GB 312
# bf16, 156 TF32, 2.039 TB/s, NVLink 600 GB/s; B200 (HGX B200 / 8 GPUs) 2.25 PFLOPS bf16, 1.1
# TF32, 8 TB/s (XLA's target description: 7.67), NVLink 5 1.8 TB/s. TPUs from Google Cloud's TPU
# pages, per chip:
#   v4:  https://cloud.google.com/tpu/docs/v4  (275 TFLOPs bf16; HBM2 1200 GBps). The page gives
#        no per-chip ICI bandwidth, only the pod's all-reduce bandwidth (1.1 PB/s over 4096
#        chips); 2 x that / 4096 = 537 GBps, the relation the v5e and v6e pages' numbers obey
#        (51.2 TB/s over 256 chips = 400 GBps / 2; 102.4 TB/s over 256 = 800 GBps / 2).
#   v5e: https://cloud.google.com/tpu/docs/v5e  (197 TFLOPs; 819 GBps; ICI 400 GBps)
#   v5p: https://cloud.google.com/tpu/docs/v5p  (459 TFLOPs; 2765 GBps; ICI 1200 GBps)
#   v6e: https://cloud.google.com/tpu/docs/v6e  (918 TFLOPs; 1638 GBps; ICI 800 GBps)
CHIPS = {c.name: c for c in (
    Chip('h100 pcie', 756e12),
    Chip('h100', 989e12, 3.35e12, 900e9, 494e12),
    Chip('h200', 989e12, 4.8e12, 900e9, 494e12),
    Chip('a100', 312e12, 2.039e12, 600e9, 156e12),
    Chip('b200', 2.25e15, 8e12, 1.8e12, 1.1e15),
    Chip('v4', 275e12, 1200e9, 2 * 1.1e15 / 4096),
    Chip('v5e', 197e12, 819e9, 400e9),
    Chip('v5p', 459e12, 2765e9, 1200e9),
    Chip('v6e', 918e12, 1638e9, 800e9),
)}
# jax's device_kind (lower case) to a chip, matched by substring, most specific first.
_DEVICE_KINDS = (
    ('h100 pcie', 'h100 pcie'), ('h100', 'h100'), ('h200', 'h200'), ('a100', 'a100'),
    ('b200', 'b200'),
    ('tpu v4', 'v4'), ('tpu v5 lite', 'v5e'), ('tpu v5e', 'v5e'), ('tpu v5p', 'v5p'),
    ('tpu v5', 'v5p'),  # v5p reports itself as 'TPU v5'
    ('tpu v6 lite', 'v6e'), ('tpu v6e', 'v6e'),  # v6e (Trillium)
)


def chip(device_kind: str | None = None) -> Chip | None:
    """The chip of `device_kind` (default: the first jax device); None when unknown (CPU)."""
    if device_kind is None:
        device_kind = jax.devices()[0].device_kind
    kind = device_kind.lower()
    return next((CHIPS[name] for key, name in _DEVICE_KINDS if key in kind), None)


def peak_flops_per_device(device_kind: str | None = None) -> float | None:
    """Datasheet peak of `device_kind` (default: the first jax device); None when unknown (CPU)."""
    found = chip(device_kind)
    return found.peak_bf16_flops if found else None


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
