"""t2t: the Transformer of "Attention Is All You Need" in JAX/Flax."""

from t2t import platforms as _platforms

# Before any jax computation: no TPU backend (and none of libtpu's start-up errors) on hosts
# without TPU chips, even with libtpu installed.
_platforms.skip_absent_tpu()
