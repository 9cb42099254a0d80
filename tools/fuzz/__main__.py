import sys

from tools.fuzz.job import main

sys.exit(main())
