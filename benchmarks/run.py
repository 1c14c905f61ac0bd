"""Run gradkit's benchmarks (``make bench``); the same as ``gradkit bench [args]``."""

import sys

from gradkit._bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
