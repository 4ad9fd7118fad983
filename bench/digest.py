"""Tie a stored result to its commit through the digest of the source that ran.

Usage:
    python bench/digest.py                 # the working tree's digest
    python bench/digest.py REV [REV ...]   # each revision's digest
    python bench/digest.py --find DIGEST [--last 50]

A result's ``environment.cucopy.source_digest`` (bench suite) or
``source_digest`` (probes) digests ``cucopy/`` and ``bench/`` as they ran; the
``commit`` beside it comes from the copied checkout's ``.git``, which may be
older than its files. ``--find`` walks the last commits and prints every one whose
files match (a run of commits that left the source alone all match). Digests stored up
to run 30 followed a first rule that left out ``.c`` files; ``--find`` tries it too and
says so.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import DIGEST_SUFFIXES_V1, REPO, source_digest  # noqa: E402


def main(argv=None) -> int:
    """Print digests; with ``--find``, the matching commit (exit 1 when none)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("revs", nargs="*")
    ap.add_argument("--find", metavar="DIGEST")
    ap.add_argument("--last", type=int, default=50, help="commits --find walks")
    args = ap.parse_args(argv)
    if args.find:
        log = subprocess.run(
            ["git", "rev-list", f"--max-count={args.last}", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        )
        found = []
        for rev in log.stdout.split():
            if source_digest(rev=rev) == args.find:
                found.append(rev)
            elif source_digest(rev=rev, suffixes=DIGEST_SUFFIXES_V1) == args.find:
                found.append(f"{rev} (the first rule: C sources not digested)")
        for rev in found:  # newest first; commits that left the source alone match too
            print(rev)
        if not found:
            print(f"no commit among the last {args.last} has source digest {args.find}")
        return 0 if found else 1
    if not args.revs:
        print(source_digest())
    for rev in args.revs:
        print(rev, source_digest(rev=rev))
    return 0


if __name__ == "__main__":
    sys.exit(main())
