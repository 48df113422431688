"""``python -m parallel_lib.tensor_parallel``: tensor-parallel training, launched here or by torchrun."""

from parallel_lib.tensor_parallel.cli import main

raise SystemExit(main())
