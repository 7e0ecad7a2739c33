"""``python -m agspec_gpu``: the ``agspec-gpu`` command line."""

import sys

from agspec_gpu.cli import main

sys.exit(main())
