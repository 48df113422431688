"""``python -m parallel_lib.inference``: serve prompts with one strategy, launched here or by torchrun."""

from parallel_lib.inference.cli import main

raise SystemExit(main())
