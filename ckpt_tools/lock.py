"""Refresh the test environment's lock, ``requirements/test.lock``: the exact versions CI tests.

    python -m ckpt_tools.lock                # resolve today's newest within pyproject's ranges, write the lock

The README's commands install with ``-c requirements/test.lock``, so a fresh clone on
any day gets exactly the versions the suite last passed with. This builds a new venv
(``fresh_env``), lets pip resolve ``.[test]`` with nothing pinned but torch, and writes
what it installed. Commit the refreshed lock on its own, after the suite has run on it
(``python -m ckpt_tools.latest_deps`` runs the suite on the same resolution first).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path

from ckpt_tools.fresh_env import ROOT, TORCH, fresh_env

LOCK = ROOT / "requirements" / "test.lock"

HEADER = """\
# The test environment, exactly: every distribution `pip install -e '.[test]'` resolved,
# after {torch}, on {date} (Python {python}, {machine}).
# Used as constraints (`pip install -c requirements/test.lock ...`) by the README's two commands.
# Refresh with `python -m ckpt_tools.lock`, run the suite on it, commit it alone.
"""


def lock_text(versions: dict[str, str]) -> str:
    """The lock file: the header, then ``name==version`` sorted by name.

    torch is written without its local label (``2.13.0``, not ``2.13.0+cpu``): a
    constraint without one admits every build of that release, CPU or CUDA.
    """
    header = HEADER.format(torch=TORCH, date=datetime.date.today().isoformat(),
                           python=platform.python_version(), machine=f"{sys.platform}-{platform.machine()}")
    lines = [f"{name}=={version.split('+')[0]}" for name, version in sorted(versions.items(), key=lambda kv: kv[0].lower())]
    return header + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=LOCK, help="where to write the lock (default: %(default)s)")
    args = parser.parse_args(argv)
    with fresh_env("test") as env:
        versions = env.versions()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(lock_text(versions))
    print(f"wrote {args.out} ({len(versions)} distributions)")


if __name__ == "__main__":
    main()
