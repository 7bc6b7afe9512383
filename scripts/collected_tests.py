"""Print how many tests pytest collects for the given arguments (``scripts/test.sh`` refuses a
run that collects too few). Counted by a plugin from the collected items, so the count does not
depend on the output format that verbosity flags such as ``-q``/``-qq`` choose."""

import contextlib
import io
import sys

import pytest


class _Count:
    items = 0

    def pytest_collection_finish(self, session):
        self.items = len(session.items)


def main(args) -> int:
    count = _Count()
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        code = pytest.main(["--collect-only", "-p", "no:cacheprovider", *args], plugins=[count])
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        sys.stderr.write(report.getvalue())
        print(f"error: pytest collection failed (exit {int(code)})", file=sys.stderr)
        return int(code)
    print(count.items)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
