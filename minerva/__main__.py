import sys

from minerva.console import main

sys.exit(main())
