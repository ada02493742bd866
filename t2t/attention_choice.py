"""Which attention kernel a config gets where it runs, decided from the config before any compile.

    impl, reason = resolve_attention_impl(config, 'gpu', compute_capability=(9, 0))
    config.attention_impl = impl      # what TransformerConfig.from_config then reads

attention_impl='auto' (the configs' default) is cuDNN's fused flash attention ('cudnn') on an
NVIDIA GPU wherever cuDNN accepts what the model hands it, and the written-out softmax ('xla')
everywhere else, each with a one-line reason. A config that names a kernel where it cannot run is
a ValueError of one line here, not a failure inside a compile.

cuDNN's conditions, one rule each in `cudnn_problem`, are jax's own checks at trace time
(jax/_src/cudnn/fused_attention_stablehlo.py, jax 0.10: check_layout, check_is_flash_attention)
and cuDNN's support matrix; docs/attention.md ("Which kernel a run gets") says why each holds.
The sharding conditions (no split of the length or head-dim axes) always hold under t2t's rules.
"""

from __future__ import annotations

from t2t.attention import KERNELS

AUTO = 'auto'
IMPLS = (AUTO, *KERNELS)  # the values of config.attention_impl
# The platforms (jax.default_backend(), or a dry run's target) whose devices run a kernel.
_NVIDIA = ('gpu', 'cuda')
_PLATFORMS = {'cudnn': _NVIDIA, 'splash': ('tpu',)}
_RUNS_ON = {'cudnn': 'cuDNN flash attention runs on NVIDIA GPUs only',
            'splash': 'splash attention runs on TPU only'}
_CUDNN_DTYPES = ('bfloat16', 'float16')
AMPERE, HOPPER = (8, 0), (9, 0)


def kernel_missing(impl: str, platform: str) -> str | None:
    """Why attention_impl's kernel does not run on `platform` ('cpu', 'gpu', 'tpu'), or None."""
    if impl in _PLATFORMS and platform not in _PLATFORMS[impl]:
        return _RUNS_ON[impl]
    return None


def head_dim_limit(compute_capability: tuple[int, int] | None) -> int:
    """cuDNN's largest head dim as jax checks it when it traces on that GPU (None: on no GPU)."""
    return 256 if compute_capability is not None and compute_capability >= HOPPER else 128


def cudnn_problem(config, compute_capability: tuple[int, int] | None = None) -> str | None:
    """Why cuDNN flash attention cannot run config's attention on an NVIDIA GPU, or None.

    compute_capability: the GPU of the process that traces the step, (major, minor); None where
    that process has none (an ahead-of-time compile on a CPU host).
    """
    if compute_capability is not None and compute_capability < AMPERE:
        return (f'cuDNN flash attention needs compute capability >= 8.0 (Ampere), the GPU has '
                f'{compute_capability[0]}.{compute_capability[1]}')
    if config.dtype not in _CUDNN_DTYPES:
        return f'dtype={config.dtype}: cuDNN flash attention takes bfloat16 or float16'
    head_dim, limit = config.d_model // config.num_heads, head_dim_limit(compute_capability)
    if head_dim % 8 or head_dim > limit:
        where = ('on a CPU host compiling ahead of time' if compute_capability is None
                 else f'on compute capability {compute_capability[0]}.{compute_capability[1]}')
        return (f'head dim {head_dim} (d_model={config.d_model} / num_heads={config.num_heads}): '
                f'cuDNN takes multiples of 8 up to {limit} {where}')
    if config.attention_dropout_rate > 0:
        return (f'attention_dropout_rate={config.attention_dropout_rate}: only the written-out '
                'softmax (xla) drops attention weights')
    if config.max_len % 2:
        return f'max_len={config.max_len}: the training step of cuDNN needs even lengths'
    return None


def _cudnn_summary(config) -> str:
    return (f'{config.dtype}, head dim {config.d_model // config.num_heads}; training rows '
            "masked by segment ids (a bias), evaluation and search by lengths; beam search's "
            'cached steps (one query a row) use the written-out softmax')


def resolve_attention_impl(config, platform: str,
                           compute_capability: tuple[int, int] | None = None) -> tuple[str, str]:
    """(the kernel config.attention_impl comes to on `platform`, a one-line reason).

    config: the experiment's ConfigDict (reads attention_impl, dtype, d_model, num_heads,
    attention_dropout_rate, max_len). platform: where the step runs, jax.default_backend()
    of the process ('cpu', 'gpu', 'tpu') or a dry run's target ('gpu', 'tpu').
    compute_capability: as for cudnn_problem. A kernel named where it cannot run: ValueError, one
    line naming the key, the kernel and what to use instead.
    """
    impl = config.attention_impl
    if impl not in IMPLS:
        raise ValueError(f'--config.attention_impl={impl!r} must be one of {IMPLS}')
    if impl != AUTO:
        missing = kernel_missing(impl, platform)
        if missing:
            others = ', '.join(('auto', 'xla', 'dot_product')
                               + (('splash',) if platform == 'tpu' else ()))
            raise ValueError(f'--config.attention_impl={impl}: {missing}, the target is '
                             f'{platform} (use {others})')
        problem = cudnn_problem(config, compute_capability) if impl == 'cudnn' else None
        if problem:
            raise ValueError(f'--config.attention_impl=cudnn: {problem} (use auto or xla)')
        if impl == 'cudnn':
            return impl, f'cuDNN flash attention: {_cudnn_summary(config)}'
        return impl, 'as configured'
    if platform not in _NVIDIA:
        return 'xla', f'cuDNN flash attention needs an NVIDIA GPU, the target is {platform}'
    problem = cudnn_problem(config, compute_capability)
    if problem:
        return 'xla', f'not cuDNN: {problem}'
    return 'cudnn', f'cuDNN flash attention: {_cudnn_summary(config)}'


def describe(configured: str, impl: str, reason: str) -> str:
    """The line a run prints: 'attention_impl=auto -> cudnn (cuDNN flash attention: ...)'."""
    return f'attention_impl={configured} -> {impl} ({reason})'


def this_process() -> tuple[str, tuple[int, int] | None]:
    """(jax.default_backend(), the compute capability of its first device on a CUDA GPU, else
    None): the arguments of resolve_attention_impl for a step this process runs."""
    import jax

    platform = jax.default_backend()
    device = jax.devices()[0]
    capability = getattr(device, 'compute_capability', None)
    if platform != 'gpu' or not capability:
        return platform, None
    if 'cuda' not in device.client.platform_version.lower():
        return 'rocm', None  # an AMD GPU: no cuDNN
    major, minor = (int(x) for x in str(capability).split('.')[:2])
    return platform, (major, minor)


def resolve_for_this_process(config) -> tuple[str, str]:
    """resolve_attention_impl for the devices of this process."""
    return resolve_attention_impl(config, *this_process())
