"""``python -m parallel_lib.runtime``: check the set-up with an all-reduce over the ranks."""

from parallel_lib.runtime.environment import main

raise SystemExit(main())
