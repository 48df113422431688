"""``python -m parallel_lib.sharding``: ZeRO training, launched here or by torchrun."""

from parallel_lib.sharding.cli import main

raise SystemExit(main())
