"""Take the README's dashboard screenshot: a real 3-daemon swarm on loopback training the tiny
model, its dashboard opened in headless Chromium.

    .venv/bin/python scripts/dashboard_screenshot.py [--out docs/img/dashboard.png]
        [--steps 60] [--chromium /usr/bin/chromium] [--width 1280]

Needs Debian's ``chromium`` and Playwright (``pip install playwright==1.63.0``; no browser
download: the system browser is driven). Takes a few minutes on 2 cores; stops its daemons.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from atomd.launch import DaemonProcess, start_swarm, stop_all, wait_until  # noqa: E402

TOKEN = "screenshot-token"
JOB = {
    "preset": "tiny", "seq_len": 32, "micro_batch_size": 4, "eval_batches": 2,
    "eval_interval": 10, "log_interval": 1, "checkpoint_interval": 20, "warmup_steps": 2,
    "max_steps": 100000,
}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "img" / "dashboard.png")
    ap.add_argument("--steps", type=int, default=60, help="steps every peer trains first")
    ap.add_argument("--chromium", default=shutil.which("chromium") or "")
    ap.add_argument("--width", type=int, default=1280)
    args = ap.parse_args()
    if not args.chromium:
        sys.exit("no chromium: apt-get install chromium, or pass --chromium PATH")
    from playwright.sync_api import sync_playwright

    started: list[DaemonProcess] = []
    with tempfile.TemporaryDirectory(prefix="atomd-dash-") as tmp:
        try:
            ds = start_swarm(Path(tmp), 3, started=started, env={"ATOMD_CONTROL_TOKEN": TOKEN})
            a = ds[0]
            with a.client() as c:
                job = c.post("/v1/jobs", json=JOB)
                job.raise_for_status()
                job_id = job.json()["id"]

            def trained() -> bool:
                r = httpx.get(f"{a.url}/v1/jobs/{job_id}/curves", headers=a.headers, timeout=10)
                peers = r.json()["peers"]
                return len(peers) == 3 and all(
                    p["points"] and p["points"][-1]["step"] >= args.steps for p in peers
                )

            print(f"swarm of 3 at {a.url}; training until every peer is at step {args.steps}")
            wait_until(trained, timeout=900, interval=2, what=f"{args.steps} steps on 3 peers")
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
                page = browser.new_page(viewport={"width": args.width, "height": 900})
                page.goto(f"{a.url}/dashboard#token={TOKEN}")
                page.wait_for_function(  # a function, not a string: the page's CSP forbids eval
                    "() => document.querySelectorAll('#chart-loss path.series').length === 3 && "
                    "document.querySelectorAll('#round-table tbody tr').length > 0",
                    timeout=120_000,
                )
                time.sleep(2.5)  # one more poll: every section fresh
                args.out.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(args.out), full_page=True)
                browser.close()
            print(f"wrote {args.out}")
        finally:
            for line in stop_all(started):
                print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
