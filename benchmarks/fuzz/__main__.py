import sys

from benchmarks.fuzz.job import main

sys.exit(main())
