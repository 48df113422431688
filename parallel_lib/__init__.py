"""parallel_lib: the small library behind the parallel-llm-course notebooks.

Each module holds one idea of the course (see README.md's course map); notebooks,
tests, benchmarks and command-line runs import the modules directly, e.g.
``from parallel_lib.data import partition_dataset``.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
