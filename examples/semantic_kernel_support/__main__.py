"""``python -m examples.semantic_kernel_support [--reject]``."""

import argparse
import sys

from .demo import main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m examples.semantic_kernel_support", description=__doc__)
    parser.add_argument("--reject", action="store_true", help="the approver rejects the account deletion")
    sys.exit(main(reject=parser.parse_args().reject))
