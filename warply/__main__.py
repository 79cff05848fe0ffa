import sys

from warply.cli import main

sys.exit(main())
