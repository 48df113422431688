"""``python -m parallel_lib.data_parallel``: data-parallel training, launched here or by torchrun."""

from parallel_lib.data_parallel.cli import main

raise SystemExit(main())
