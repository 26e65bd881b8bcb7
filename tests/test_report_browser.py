"""The report page in a real browser: Debian's ``chromium``, headless (installed by ``make
setup``), opens the page of a JSONL, a Parquet and a ``--ray`` output and checks that it
renders (its headings and charts are in the DOM), that nothing logs a console error and that
the browser makes no network request; it saves a screenshot of each.

The browser is driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``:
NUL-terminated JSON messages on file descriptors 3 and 4), so the test needs no websocket
client. A control page that tries to load an image from the network shows that the check
sees such a request.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from test_report import (
    make_records,
    meta_for,
    pairs_check_dict,
    self_check_dict,
    write_input,
    write_output,
    write_pairs_output,
)

from icqs_fast.report.run_report import write_report

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Where the screenshots go (kept after the test for a person to look at).
SHOTS = Path(os.environ.get("ICQS_REPORT_SHOTS", "/tmp/icqs-report-shots"))


class Browser:
    """Headless chromium driven over ``--remote-debugging-pipe``."""

    def __init__(self, tmp: Path) -> None:
        if CHROMIUM is None:
            pytest.fail("chromium is not installed; `make setup` installs it (Debian: "
                        "apt-get install -y chromium)")
        to_child_r, self._w = os.pipe()
        self._r, from_child_w = os.pipe()

        def fds() -> None:  # the child's fds 3 (commands in) and 4 (replies out)
            os.dup2(to_child_r, 3)
            os.dup2(from_child_w, 4)

        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-extensions", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--remote-debugging-pipe",
             f"--user-data-dir={tmp / 'profile'}", "about:blank"],
            # close_fds would run after preexec_fn and close 3 and 4 again.
            preexec_fn=fds, close_fds=False,
            stdout=subprocess.DEVNULL, stderr=open(tmp / "chromium.log", "wb"))
        self.log = tmp / "chromium.log"
        os.close(to_child_r)
        os.close(from_child_w)
        self._buf = b""
        self._id = 0
        self.events: list[dict] = []

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            if time.monotonic() > deadline:
                raise TimeoutError("chromium did not answer in time")
            chunk = os.read(self._r, 1 << 16)
            if not chunk:
                err = self.log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"chromium closed its pipe: {err}")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 60.0) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            r = self._read(deadline)
            if r.get("id") == self._id:
                if "error" in r:
                    raise RuntimeError(f"{method}: {r['error']}")
                return r["result"]
            self.events.append(r)

    def wait_for(self, method: str, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        for e in self.events:
            if e.get("method") == method:
                return e
        while True:
            e = self._read(deadline)
            self.events.append(e)
            if e.get("method") == method:
                return e

    def open(self, url: str, shot: Path) -> dict:
        """Load ``url`` in a fresh tab (1280 x 2400), wait for its load event and a moment
        for late requests; return what happened: console errors, network requests other than
        the page itself, the DOM's headings and svg count; ``shot``: a full-page PNG."""
        self.events.clear()
        tid = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        sid = self.send("Target.attachToTarget", {"targetId": tid, "flatten": True})["sessionId"]
        for m in ("Page.enable", "Runtime.enable", "Log.enable", "Network.enable"):
            self.send(m, session=sid)
        self.send("Emulation.setDeviceMetricsOverride", {"width": 1280, "height": 2400,
                                                         "deviceScaleFactor": 1,
                                                         "mobile": False}, session=sid)
        self.send("Page.navigate", {"url": url}, session=sid)
        self.wait_for("Page.loadEventFired")
        time.sleep(0.5)
        dom = json.loads(self.send("Runtime.evaluate", {
            "expression": "JSON.stringify({h: [...document.querySelectorAll('h1,h2')]"
                          ".map(e => e.textContent), svg: document.querySelectorAll('svg')"
                          ".length, rows: document.querySelectorAll('tr').length, "
                          "title: document.title})", "returnByValue": True},
            session=sid)["result"]["value"])
        png = self.send("Page.captureScreenshot", {"format": "png",
                                                   "captureBeyondViewport": True},
                        session=sid)["data"]
        shot.parent.mkdir(parents=True, exist_ok=True)
        shot.write_bytes(base64.b64decode(png))
        errors, requests = [], []
        for e in self.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                errors.append(json.dumps(p.get("args"))[:300])
            elif m == "Runtime.exceptionThrown":
                errors.append(json.dumps(p.get("exceptionDetails"))[:300])
            elif m == "Log.entryAdded" and p["entry"].get("level") == "error":
                errors.append(p["entry"].get("text", "")[:300])
            elif m == "Network.requestWillBeSent" and p["request"]["url"] != url:
                requests.append(p["request"]["url"])
            elif m == "Network.loadingFailed" and "blocked" in str(p.get("blockedReason", "")):
                errors.append(f"blocked: {p}")
        self.send("Target.closeTarget", {"targetId": tid})
        return {"dom": dom, "errors": errors, "requests": requests}

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=10)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._w)
        os.close(self._r)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    b = Browser(tmp_path_factory.mktemp("chromium"))
    yield b
    b.close()


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "blocks"])
def test_page_renders_offline_without_errors(browser, tmp_path, kind):
    check = self_check_dict()
    name = {"jsonl": "out.jsonl", "parquet": "out.parquet", "blocks": "out"}[kind]
    out = write_output(tmp_path / name, make_records(300, check=check), meta_for(check), kind)
    base = write_output(tmp_path / "base.jsonl", make_records(300, check=check, shift=0.05),
                        meta_for(check))
    page = write_report(out, tmp_path / "report.html", baseline=base,
                        input=write_input(tmp_path / "in.jsonl", 300)).path
    got = browser.open(page.resolve().as_uri(), SHOTS / f"report-{kind}.png")
    assert got["errors"] == [] and got["requests"] == [], got
    dom = got["dom"]
    assert dom["svg"] == 3 and dom["rows"] > 40, dom
    assert dom["h"][0] == "icqs-fast run report"
    assert {"Drift against the baseline", "Self-check", "Distributions",
            "Labels against verdicts", "Least certain records",
            "Most confident mistakes", "Settings"} <= set(dom["h"]), dom["h"]
    assert (SHOTS / f"report-{kind}.png").stat().st_size > 50_000


def test_page_with_the_abstain_band_renders(browser, tmp_path):
    check = self_check_dict(sep=2.0, target=0.8)
    assert check["band"]["reached"]
    out = write_output(tmp_path / "out.jsonl", make_records(300, check=check), meta_for(check))
    page = write_report(out, tmp_path / "report.html").path
    got = browser.open(page.resolve().as_uri(), SHOTS / "report-band.png")
    assert got["errors"] == [] and got["requests"] == [], got
    assert got["dom"]["svg"] == 3 + 1, got["dom"]  # the coverage-accuracy curve


def test_pairs_page_renders(browser, tmp_path):
    """A `score --pairs` output's page: the pairwise section (accuracy, a / b / tie counts,
    the margin histogram) and the self-check's pairwise part render offline, no error."""
    out = write_pairs_output(tmp_path / "pairs.jsonl", 80, pairs_check_dict(), tie=0.01)
    page = write_report(out, tmp_path / "report.html").path
    got = browser.open(page.resolve().as_uri(), SHOTS / "report-pairs.png")
    assert got["errors"] == [] and got["requests"] == [], got
    dom = got["dom"]
    assert dom["h"][0] == "icqs-fast pairs report", dom
    assert {"Pairwise judgements", "Self-check", "Settings"} <= set(dom["h"]), dom["h"]
    assert dom["svg"] == 3 and dom["rows"] > 5, dom  # margins, reliability, band curve
    assert (SHOTS / "report-pairs.png").stat().st_size > 30_000


def test_check_sees_a_network_request(browser, tmp_path):
    """The control: the same page with an image from the network (refused by the page's
    content policy) is caught, so the check above can fail."""
    check = self_check_dict()
    out = write_output(tmp_path / "o.jsonl", make_records(50, check=check), meta_for(check))
    page = write_report(out, tmp_path / "r.html").path
    html = page.read_text(encoding="utf-8")
    page.write_text(html.replace("<main>", '<main><img src="http://127.0.0.1:9/x.png">'),
                    encoding="utf-8")
    got = browser.open(page.resolve().as_uri(), SHOTS / "control.png")
    assert any("Content Security Policy" in e for e in got["errors"]) or got["requests"], got
