"""python -m te_fusedadam_offload"""

import sys

from .cli import main

sys.exit(main())
