"""Which jax platforms a t2t process starts: only those whose chips this host has.

Without JAX_PLATFORMS jax tries every backend it knows, the TPU one first, and a missing chip is
noise on stderr: without libtpu absl prints "Unable to initialize backend 'tpu': ... libtpu.so";
with libtpu (the `tpu` extra, which ahead-of-time TPU compiles need on any machine) libtpu prints
its start-up errors (jax-ml/jax#11668); with jax's CUDA plugin (ahead-of-time GPU compiles) the
plugin checks CUDA's libraries against a driver that is not there. `skip_absent_tpu` looks for the
chips as jax itself does (the PCI probe of jax's cloud_tpu_init, NVIDIA's device files) and asks
only for what is attached: TPU chips present, jax's own choice stands (and its errors are real);
an NVIDIA GPU with the CUDA plugin, 'cuda,cpu' (a CUDA failure then fails loudly, no silent
fallback to the CPU); a GPU without the plugin, jax's own choice (its warning says the plugin is
missing); neither, 'cpu'. A JAX_PLATFORMS set by the user always wins.

`compile_only_tpu` / `compile_only_gpu` are the environments of ahead-of-time compiles for a TPU
slice or GPU nodes (t2t/aot/targets.py): the process runs on the CPU backend and uses libtpu or
the CUDA plugin only as XLA's compiler.

`reuse_freed_memory` (a CPU run, before its first jax computation) keeps the memory glibc's malloc
frees for the next allocation: XLA's CPU runtime mallocs each execution's temporaries (all of a
train step's activations) in one block and frees it after the step, and glibc maps and unmaps
blocks that large, so every step faulted in fresh pages that the kernel zeroed first
(bench/RESULTS.md, "The CPU step against PyTorch").
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys


def _cuda_plugin_installed() -> bool:
    return any(importlib.util.find_spec(f'jax_cuda{v}_plugin') for v in (12, 13))


def choose(tpu_chips: int, nvidia_gpu: bool, cuda_plugin: bool) -> str | None:
    """The jax_platforms for a host with these accelerators; None: jax's own choice."""
    if tpu_chips > 0 or (nvidia_gpu and not cuda_plugin):
        return None
    return 'cuda,cpu' if nvidia_gpu else 'cpu'


def skip_absent_tpu() -> str | None:
    """Leaves out of jax's platforms the accelerators this host lacks (`choose`).

    Returns the jax_platforms it set, or None when jax's own choice stands (also when
    JAX_PLATFORMS or jax_platforms is already set). Call it before the first jax computation
    (cli.run does, for every entry point).
    """
    if 'JAX_PLATFORMS' in os.environ:
        return None
    import jax
    from jax._src import hardware_utils  # jax's own probes of the PCI bus and /dev

    if jax.config.jax_platforms is not None:
        return None
    platforms = choose(hardware_utils.num_available_tpu_chips_and_device_id()[0],
                       hardware_utils.has_visible_nvidia_gpu(), _cuda_plugin_installed())
    if platforms is not None:
        jax.config.update('jax_platforms', platforms)
    return platforms


def cpu_only() -> bool:
    """Whether this process's jax platforms are the CPU alone (JAX_PLATFORMS or jax_platforms)."""
    if 'JAX_PLATFORMS' in os.environ:
        return os.environ['JAX_PLATFORMS'] == 'cpu'
    import jax

    return jax.config.jax_platforms == 'cpu'


# mallopt's parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


def reuse_freed_memory() -> bool:
    """glibc's malloc keeps freed memory in its one heap for the next allocation, in a CPU run.

    One arena (a thread's own arena maps a block this large whatever the settings), no mmap for
    large blocks, no trimming of the heap's top: the next step's temporaries take the pages the
    last step's left, with no page fault. The process keeps its peak memory. Call it before the
    first jax computation (XLA's threads take their arena at their first allocation). Returns
    whether glibc took the settings (False elsewhere: another libc has no mallopt to ask).
    """
    try:
        libc = ctypes.CDLL(None)
    except (OSError, TypeError):  # no C library to load this way (Windows)
        return False
    if not hasattr(libc, 'gnu_get_libc_version'):
        return False
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1))
    return all(libc.mallopt(param, value) == 1 for param, value in settings)


def prepare_cpu_host() -> None:
    """The CPU host's setting of a CPU-only run (reuse_freed_memory); accelerator hosts, whose
    steps keep their temporaries on the device, stay as they are."""
    if cpu_only():
        reuse_freed_memory()


def compile_only_tpu(accelerator_type: str) -> None:
    """Environment for compiling for a TPU slice on this host's CPU (before any jax computation).

    The CPU backend runs the process; libtpu is loaded only for XLA's TPU compiler, so it never
    opens TPU chips: its multi-process lock (which would stop a second compile, or a compile next
    to a training run on a TPU VM) and the cloud metadata query are turned off, and the slice's
    accelerator type and a single local worker keep libtpu's start-up quiet.
    """
    os.environ['JAX_PLATFORMS'] = 'cpu'
    os.environ['TPU_SKIP_MDS_QUERY'] = '1'
    os.environ['ALLOW_MULTIPLE_LIBTPU_LOAD'] = '1'
    os.environ.setdefault('TPU_ACCELERATOR_TYPE', accelerator_type)
    os.environ.setdefault('TPU_WORKER_HOSTNAMES', 'localhost')
    os.environ.setdefault('TPU_WORKER_ID', '0')
    if 'jax' in sys.modules:  # imported already: its config has read JAX_PLATFORMS
        import jax

        jax.config.update('jax_platforms', 'cpu')


def compile_only_gpu() -> None:
    """Environment for compiling for GPU nodes on this host's CPU (before any jax computation):
    the CPU backend runs the process, XLA's CUDA compiler (the `gpu-aot` extra's plugin) only
    compiles, so no GPU is opened even where one is attached. ImportError (one line) without it."""
    if not _cuda_plugin_installed():
        raise ImportError("XLA's CUDA compiler is not installed: pip install -e '.[gpu-aot]' "
                          '(jax[cuda12] pinned to the jax in use)')
    os.environ['JAX_PLATFORMS'] = 'cpu'
    if 'jax' in sys.modules:  # imported already: its config has read JAX_PLATFORMS
        import jax

        jax.config.update('jax_platforms', 'cpu')
