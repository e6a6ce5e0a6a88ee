"""`python -m tensorport …` and the `tensorport` command a wheel installs: the `tensorport`
executable the wheel carries (or the one `find_binary` finds: `$TENSORPORT_BIN` overrides), run
with the same arguments in place of this process."""

import os
import sys


def main() -> None:
    from . import find_binary

    binary = find_binary()
    os.execv(binary, [binary] + sys.argv[1:])


if __name__ == "__main__":
    main()
