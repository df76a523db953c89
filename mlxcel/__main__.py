import sys

from mlxcel.cli import main

sys.exit(main())
