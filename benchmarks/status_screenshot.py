"""The screenshot in docs/monitoring.md: the README's loop under ``phalanx run -n 2 --status``, seen in Chromium.

    python benchmarks/status_screenshot.py [--out docs/monitoring-page.png] [--seconds 15]

Takes the README's "four changed lines" example as it is (only its epoch count raised, so the
job is still running), starts it with ``phalanx run -n 2 --status PORT``, opens the printed link
in Debian's headless Chromium (Playwright, ``/usr/bin/chromium``), waits ``--seconds`` once the
workers report, saves a full-page screenshot and a ``/metrics`` excerpt, and stops the job.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "monitoring-page.png"))
    p.add_argument("--seconds", type=float, default=15.0)
    args = p.parse_args()
    readme = open(os.path.join(ROOT, "README.md")).read()
    loop = re.search(r"## Your loop.*?```python\n(.*?)```", readme, re.S).group(1)
    loop = loop.replace("range(10)", "range(1000)")
    work = tempfile.mkdtemp(prefix="status-shot-")
    script = os.path.join(work, "train.py")
    with open(script, "w") as f:
        f.write(loop)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    err = open(os.path.join(work, "launcher.err"), "w+")
    cli = [sys.executable, "-c", "import sys; from phalanx.cli import main; sys.exit(main())"]
    job = subprocess.Popen([*cli, "run", "-n", "2", "--status", str(port), script], cwd=work, stderr=err,
                           stdout=subprocess.DEVNULL)
    try:
        link = None
        while link is None:
            err.seek(0)
            found = re.search(r"status page at (\S+)", err.read())
            link = found.group(1) if found else None
            if job.poll() is not None:
                raise SystemExit(f"the job ended first: {open(err.name).read()}")
            time.sleep(0.2)  # sleep: polling the launcher's log for the link it prints
        from playwright.sync_api import sync_playwright

        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1500, "height": 900})
            page.goto(link)
            page.wait_for_function("document.querySelector('#workers tbody tr td:nth-child(6)') && "
                                   "document.querySelector('#workers tbody tr td:nth-child(6)').textContent !== '–'",
                                   timeout=180_000)
            time.sleep(args.seconds)  # sleep: let the throughput chart fill for the picture
            page.screenshot(path=args.out, full_page=True)
            token = link.split("token=")[1]
            req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer "
                                                                                                      f"{token}"})
            print(urllib.request.urlopen(req, timeout=10).read().decode())
            browser.close()
        print(f"wrote {args.out}", file=sys.stderr)
    finally:
        job.send_signal(signal.SIGINT)
        job.wait(timeout=60)


if __name__ == "__main__":
    main()
