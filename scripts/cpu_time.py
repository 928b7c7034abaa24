"""Wall and CPU time (user + sys) of a command and every process it starts, as JSON on stderr.

``time`` counts only the descendants their parents waited for; a test's rank processes are often
reaped by a server that is itself never waited for (multiprocessing's fork server, a daemon). This
runs the command as a child subreaper (Linux), so orphans come back here and are waited for when
they exit, and their CPU time is counted too.

    python scripts/cpu_time.py -- .venv/bin/python -m pytest -q tests/mp
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print("cpu_time: cannot become a child subreaper; orphans' CPU time is not counted", file=sys.stderr)
    start = time.monotonic()
    code = subprocess.call(argv)
    wall = time.monotonic() - start
    while True:  # orphans that were re-parented here: wait for each, so its time is counted
        try:
            os.wait()
        except ChildProcessError:
            break
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = os.getloadavg()
    report = {"wall_s": round(wall, 1), "user_s": round(usage.ru_utime, 1), "sys_s": round(usage.ru_stime, 1)}
    report["cpu_s"] = round(usage.ru_utime + usage.ru_stime, 1)
    report["loadavg_1_5_15"] = [round(x, 2) for x in load]
    print(json.dumps(report), file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
