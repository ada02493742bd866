"""t2t: the Transformer of "Attention Is All You Need" in JAX/Flax.

Importing t2t (or any of its modules) changes no jax setting and no environment variable; the
entry points choose the platforms when they start (`platforms.skip_absent_tpu`, via cli.run).
"""
