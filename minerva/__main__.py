import sys

from minerva.cli import main

sys.exit(main())
