"""`python -m infinikv.native`: build the kernels for this CPU now (make's set-up step)."""

import sys

from infinikv.native import available, build_dir

print(f"native kernels: {'ready in ' + str(build_dir()) if available() else 'unavailable'}", file=sys.stderr)
