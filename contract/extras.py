"""What a command says when the package was installed without the extra it needs: `pip install
'transfer-sentiment[client]'` installs all three console scripts, and only `sentiment-client` can run there. The
others end with one line naming the extra and the module that is missing, and exit 2, instead of a traceback."""

from __future__ import annotations

import sys

from contract.version import DISTRIBUTION

# The project's own packages: one of these missing is a broken install or a bug, never an extra left out.
OWN = frozenset({"contract", "serving", "trainer"})


def missing_extra(command: str, extra: str, error: ModuleNotFoundError) -> int:
    """Print `command`'s line for `error` (a module of `extra` is not installed) and return the exit status, 2;
    re-raise `error` when the missing module is one of the project's own."""
    module = (error.name or "").partition(".")[0]
    if not module or module in OWN:
        raise error
    print(f"error: {command} needs the {extra!r} extra (no module named {module!r}): "
          f"pip install '{DISTRIBUTION}[{extra}]'", file=sys.stderr)
    return 2
