import sys

from sandbox_runner.cli import main

sys.exit(main())
