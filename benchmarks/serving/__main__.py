import sys

from benchmarks.serving.run import main

sys.exit(main())
