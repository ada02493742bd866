"""Which jax platforms a t2t process starts: the TPU backend only where TPU chips are attached.

With libtpu installed (the `tpu` extra, which ahead-of-time TPU compiles need on any machine), jax
tries its TPU backend first wherever it runs. On a host without TPU chips libtpu then prints its
start-up errors (accelerator type, worker hostnames, INVALID_ARGUMENT) to stderr before jax falls
back to the next backend (jax-ml/jax#11668). jax's own cloud_tpu_init selects 'tpu,cpu' when it
finds TPU chips on the PCI bus; `skip_absent_tpu` is its counterpart for hosts without them.
A JAX_PLATFORMS set by the user always wins.

`compile_only_tpu` / `compile_only_gpu` are the environments of ahead-of-time compiles for a TPU
slice or GPU nodes (t2t/aot/targets.py): the process runs on the CPU backend and uses libtpu or
the CUDA plugin only as XLA's compiler.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys


def _libtpu_installed() -> bool:
    return (importlib.util.find_spec('libtpu') is not None
            or bool(os.environ.get('TPU_LIBRARY_PATH')))


def _cuda_plugin_installed() -> bool:
    return any(importlib.util.find_spec(f'jax_cuda{v}_plugin') for v in (12, 13))


def _gpu_attached() -> bool:
    """An NVIDIA GPU is visible: the driver's device files (/dev/nvidia0, ...), as a container
    given GPUs has them too."""
    return bool(glob.glob('/dev/nvidia[0-9]*') or glob.glob('/proc/driver/nvidia/gpus/*'))


def skip_absent_tpu() -> str | None:
    """Leaves out jax's TPU backend when libtpu is installed but no TPU chip is attached, and its
    CUDA backend when the CUDA plugin is installed (the `gpu-aot` extra) but no GPU is (the
    plugin's start-up check prints a traceback on such a host, jax-ml/jax's xla_cuda12).

    Returns the jax_platforms it chose ('cuda,cpu' with a CUDA plugin and a GPU, else 'cpu'), or
    None when jax's own choice stands: JAX_PLATFORMS or jax_platforms already set, neither
    libtpu nor the CUDA plugin, TPU chips present. Call it before the first jax computation
    (cli.run does, for every entry point).
    """
    cuda = _cuda_plugin_installed()
    if 'JAX_PLATFORMS' in os.environ or not (_libtpu_installed() or cuda):
        return None
    import jax

    if jax.config.jax_platforms is not None:
        return None
    if _libtpu_installed():
        from jax._src import hardware_utils  # the PCI probe of jax's cloud_tpu_init

        if hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0:
            return None
    elif cuda and _gpu_attached():
        return None  # jax's own choice: the GPU
    platforms = 'cuda,cpu' if cuda and _gpu_attached() else 'cpu'
    jax.config.update('jax_platforms', platforms)
    return platforms


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
