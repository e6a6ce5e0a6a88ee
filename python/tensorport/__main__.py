"""`python -m tensorport …` and the `tensorport` command a wheel installs: the `tensorport`
command line, compiled into the package's extension and run in this process (its child
processes start as `python -m tensorport` too). `$TENSORPORT_BIN`, or an executable the wheel
carries (`tensorport/bin/tensorport`, the CUDA build), runs in its place instead."""

import os
import sys


def main() -> None:
    from . import _carried_binary, _native

    binary = os.environ.get("TENSORPORT_BIN") or _carried_binary()
    if binary:
        os.execv(binary, [binary] + sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    code = _native._cli_main(["tensorport"] + sys.argv[1:], [sys.executable, "-m", "tensorport"])
    # Not sys.exit: the command line has finished with this process (its signal handling, its
    # threads); nothing of Python's is left to run.
    os._exit(code)


if __name__ == "__main__":
    main()
