"""`python -m ferrylm ...` is `ferry ...` (the form torchrun starts: `torchrun ... -m ferrylm serve ...`)."""

import sys

from ferrylm.cli import main

if __name__ == "__main__":
    sys.exit(main())
