"""
test_lessons.py's process: its JAX backend started for fast compiles, before any test runs.
"""

import os

# XLA:CPU's fastest compile: backend at -O0, the classic elementwise emitters. The tests'
# JAX programs are small and compiled once, so their compiles are most of their time.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def start_jax_backend_for_fast_compiles():
    """Start this process's JAX backend with FAST_COMPILE, then put XLA_FLAGS back as it was:
    XLA reads the flags once, when its backend starts, and the lessons the tests launch as
    processes must see the reader's environment, not this one."""
    try:
        import jax
    except ImportError:  # the JAX tests skip themselves
        return
    before = os.environ.get("XLA_FLAGS")
    os.environ["XLA_FLAGS"] = f"{FAST_COMPILE} {before or ''}"
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.devices()  # the backend starts here
    finally:
        os.environ.pop("XLA_FLAGS")
        if before is not None:
            os.environ["XLA_FLAGS"] = before


start_jax_backend_for_fast_compiles()
