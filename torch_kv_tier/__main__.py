"""``python -m torch_kv_tier`` is the ``torch-kv-tier`` command."""

import sys

from torch_kv_tier.cli import main

sys.exit(main())
