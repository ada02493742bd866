"""Progress lines of a long data preparation: pairs done, pairs/s, ETA and memory, every few
seconds from a background thread (so a slow chunk or sentencepiece's training still shows life).

    with progress.Stage('train: tokenize+pack', total=36_000_000) as stage:
        ...; stage.advance(pairs)            # from the loop that collects finished chunks
    stage.summary()                          # 'train: tokenize+pack: 36,000,000 pairs in ...'

RSS is the resident memory of this process plus its child processes (the preparation's workers),
read from /proc; `peak` is the largest value sampled (every SAMPLE_S) while the stage ran.
"""

import os
import resource
import threading
import time

INTERVAL_S = 20.0  # a progress line at least this often
SAMPLE_S = 0.5  # memory sampled this often


def echo(line: str) -> None:
    print(line, flush=True)


def _rss_of(pid: int | str) -> int:
    try:
        with open(f'/proc/{pid}/status') as f:
            for line in f:
                if line.startswith('VmRSS:'):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _children(pid: int | str) -> list[str]:
    out = []
    try:
        for task in os.listdir(f'/proc/{pid}/task'):
            with open(f'/proc/{pid}/task/{task}/children') as f:
                out += f.read().split()
    except OSError:
        pass
    return out


def tree_rss(pid: int | None = None) -> int:
    """Bytes resident in process `pid` (default this one) and all its descendants (Linux /proc);
    elsewhere this process's peak (getrusage)."""
    root = str(pid or os.getpid())
    if not os.path.exists(f'/proc/{root}/status'):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    total, todo = 0, [root]
    while todo:
        p = todo.pop()
        total += _rss_of(p)
        todo += _children(p)
    return total


def gb(n: int) -> str:
    return f'{n / 1e9:.2f} GB'


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f'{seconds}s'
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f'{minutes}m{seconds:02d}s'
    return f'{minutes // 60}h{minutes % 60:02d}m'


class Stage:
    """One stage of the preparation: prints progress while it runs (see the module docstring).

    `total`: pairs the stage will go through (0: unknown, e.g. sentencepiece's training);
    `done`: pairs already done before this run (resumed), not counted in the rate.
    """

    def __init__(self, label: str, total: int = 0, done: int = 0, echo=echo,
                 interval: float = INTERVAL_S):
        self.label, self.total, self.done, self.resumed = label, total, done, done
        self.echo, self.interval = echo, interval
        self.start = self.end = time.perf_counter()
        self.peak = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True, name='t2t-progress')

    def __enter__(self) -> 'Stage':
        self.start = time.perf_counter()
        self.peak = tree_rss()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.end = time.perf_counter()
        self.peak = max(self.peak, tree_rss())

    def advance(self, pairs: int) -> None:
        with self._lock:
            self.done += pairs

    @property
    def seconds(self) -> float:
        return (time.perf_counter() if self._thread.is_alive() else self.end) - self.start

    def rate(self) -> float:
        """Pairs per second of this run (resumed pairs excluded)."""
        return (self.done - self.resumed) / max(self.seconds, 1e-9)

    def line(self) -> str:
        rss = tree_rss()
        self.peak = max(self.peak, rss)
        head = f'{self.label}: '
        if not self.total:
            return head + f'{duration(self.seconds)} elapsed, RSS {gb(rss)}'
        rate = self.rate()
        left = self.total - self.done
        eta = duration(left / rate) if rate > 0 else '?'
        return (head + f'{self.done:,}/{self.total:,} pairs ({100 * self.done / self.total:.1f}%)'
                f', {rate:,.0f} pairs/s, ETA {eta}, RSS {gb(rss)}')

    def summary(self) -> str:
        what = f'{self.done - self.resumed:,} pairs in ' if self.total else ''
        resumed = f' ({self.resumed:,} pairs done before, resumed)' if self.resumed else ''
        rate = f' ({self.rate():,.0f} pairs/s)' if self.total else ''
        return (f'{self.label}: {what}{self.seconds:.2f} s{rate}{resumed}, '
                f'peak RSS {gb(self.peak)}')

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(SAMPLE_S):
            self.peak = max(self.peak, tree_rss())
            if time.perf_counter() - last >= self.interval:
                last = time.perf_counter()
                self.echo(self.line())
