"""``psyswarm dashboard`` as a real process, in a real headless Chromium, following a real run.

The run: the real TCP server (``psyswarm serve``) and four real clients (three workers, a trainer) that join,
and whose elected witnesses prove each round with participant filters built as the specification defines them,
so the server's own rules award the points. The run's real auth service (against a stand-in Hub) ties two keys
to each of two contributors.

The dashboard starts before the server: the page must say the coordinator is unreachable, keep retrying, and
recover once the server is up.

The slow test follows a whole local swarm (workers and a trainer training the model) through the run's DHT: the
loss curve, tokens/s and the stages' announced workers. Set PSYSWARM_SCREENSHOT=path to save its page (the
README's picture, docs/dashboard.png, comes from it).
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import time
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from solders.keypair import Keypair

from client.backends.tcp import TcpBackend
from client.join.auth import AuthClient
from client.swarm.launcher import free_port
from coordinator_program.spec import derived
from coordinator_program.spec.bloom import build_filter, compute_key, participant_key
from coordinator_program.spec.errors import CoordinatorError
from coordinator_program.spec.state import Phase, Role
from local_backend.auth.app import AuthHTTPServer
from tests.join.test_auth import serving

CHROMIUM = Path("/usr/bin/chromium")
RUN = "dash"
STATE_TOML = f"""
run_id = "{RUN}"
[config]
min_clients = 4
max_clients = 8
num_stages = 3
witness_nodes = 3
witness_quorum = 2
warmup_time = 1
max_round_train_time = 3
round_witness_time = 1
cooldown_time = 1
rounds_per_epoch = 1000
total_steps = 1000
global_batch_size = 16
[model]
n_layers = 3
n_heads = 2
d_model = 16
seq_len = 8
"""
# Markup in a Hub user name (`<img src=x onerror=...>`) no longer reaches the page: the auth service refuses a name
# outside the Hub's namespace rule (tests/join/test_auth.py).
CONTRIBUTORS = {"tok-alice": "alice", "tok-bob": "bob"}


def sync_playwright():
    """Playwright's API, or a failure saying what is missing in CI (a skip elsewhere, naming it too)."""
    missing = None
    try:
        from playwright.sync_api import sync_playwright as start
    except ImportError:
        missing = "playwright is not installed (pip install playwright)"
    if missing is None and not CHROMIUM.exists():
        missing = f"chromium is not at {CHROMIUM} (apt-get install -y --no-install-recommends chromium)"
    if missing is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the dashboard's browser test needs a browser: {missing}")
        pytest.skip(missing)
    return start


def auth_service(hub) -> AbstractContextManager[AuthHTTPServer]:
    """The run's real auth service, knowing this test's contributors."""
    hub.users.update(CONTRIBUTORS)
    return serving(hub, run_id=RUN, capacity=8, max_integrating=0, publish_contributors=True)


def start_process(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "client.cli", *args], stdout=subprocess.PIPE,
                            stderr=log.open("w"), text=True, start_new_session=True)


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class Contributors:
    """Four clients of the run on one event loop in a thread: they join, and prove every round they witness."""

    def __init__(self, address: str, keys: list[Keypair]) -> None:
        self.address, self.keys = address, keys
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.task = asyncio.run_coroutine_threadsafe(self._run(), self.loop)

    async def _run(self) -> None:
        clients = [TcpBackend(self.address, key) for key in self.keys]
        try:
            for i, client in enumerate(clients):
                await client.connect()
                await client.join(Role.Worker if i < 3 else Role.Trainer)
            everyone = [c.identity for c in clients]
            await asyncio.gather(*(self._witness(c, everyone) for c in clients))
        finally:
            for client in clients:
                await client.close()

    async def _witness(self, client: TcpBackend, everyone: list[bytes]) -> None:
        """As an elected witness, prove each round: every client present and its work counted."""
        proved: set[tuple[int, int]] = set()
        async for state in client.updates():
            round_ = (state.epoch, state.round.height)
            if state.phase != Phase.RoundTrain or round_ in proved or client.identity not in derived.witnesses(state):
                continue
            proved.add(round_)
            keys = [k for who in everyone for k in (participant_key(who), compute_key(who))]
            try:
                await client.witness(state.round.height, build_filter(state.config, keys),
                                     build_filter(state.config, []))
            except CoordinatorError:  # the round ended meanwhile
                pass

    def stop(self) -> None:
        self.task.cancel()
        time.sleep(0.2)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def dashboard_url(process: subprocess.Popen) -> str:
    line = process.stdout.readline()  # type: ignore[union-attr]
    found = re.match(r"dashboard: (http://\S+/) ", line)
    assert found, f"the dashboard did not say where it serves: {line!r}"
    return found.group(1)


def test_the_page_follows_a_live_run_and_ranks_its_contributors(tmp_path: Path, fake_hub) -> None:
    start_browser = sync_playwright()
    from playwright.sync_api import Error as PlaywrightError

    (tmp_path / "state.toml").write_text(STATE_TOML)
    address = f"127.0.0.1:{free_port()}"
    keys = [Keypair() for _ in range(4)]
    with auth_service(fake_hub) as auth:
        for key, token in zip(keys, ["tok-alice", "tok-alice", "tok-bob", "tok-bob"], strict=True):
            AuthClient(auth.url, key, RUN, timeout=10).join(token)
        dashboard = start_process(["dashboard", "--server", address, "--run-id", RUN, "--port", "0",
                                   "--auth-url", auth.url], tmp_path / "dashboard.log")
        server = contributors = None
        try:
            url = dashboard_url(dashboard)
            with start_browser() as playwright:
                browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
                # Bypassing the page's Content-Security-Policy lets the test evaluate its own conditions, and it
                # shows the page escapes peers' text by itself: with the policy on, an inline handler could not run.
                page = browser.new_page(viewport={"width": 1200, "height": 900}, bypass_csp=True)
                page.goto(url)
                error = page.locator("#error")
                error.wait_for(state="visible", timeout=15_000)
                assert re.fullmatch(r"coordinator unreachable: cannot reach the coordinator at .+", error.inner_text())

                server = start_process(["serve", "--config", str(tmp_path / "state.toml"), "--port",
                                        address.rsplit(":", 1)[1], "--db", str(tmp_path / "run.sqlite"),
                                        "--permissionless"], tmp_path / "serve.log")
                error.wait_for(state="hidden", timeout=20_000)  # it kept retrying
                assert page.locator("#phase").inner_text() == "WaitingForMembers"

                contributors = Contributors(address, keys)
                page.wait_for_function("document.getElementById('phase').textContent !== 'WaitingForMembers'",
                                       timeout=20_000)
                assert page.locator("#phase").inner_text() in {"Warmup", "RoundTrain", "RoundWitness"}
                # Rounds of this run pass about once a second, as often as the page polls, so the phase it samples
                # may read the same each time: the step shows that it keeps following the run.
                step = page.locator("#step").inner_text()
                page.wait_for_function("shown => document.getElementById('step').textContent !== shown", arg=step,
                                       timeout=20_000)
                page.wait_for_function(
                    "document.querySelectorAll('#leaderboard tbody tr').length === 2 && [...document.querySelectorAll("
                    "'#leaderboard tbody tr')].every(row => Number(row.cells[5].textContent) > 0)", timeout=30_000)
                rows = [[cell.inner_text() for cell in row.locator("td").all()]
                        for row in page.locator("#leaderboard tbody tr").all()]
                assert sorted((r[1], r[2]) for r in rows) == sorted([("alice", "2"), ("bob", "2")]), rows
                assert all(int(r[3]) > 0 and int(r[4]) > 0 for r in rows), rows  # presence and compute
                assert [page.locator("#stages tbody tr").nth(i).locator("td").nth(1).inner_text()
                        for i in range(3)] == ["1", "1", "1"]
                assert re.fullmatch(r"proofs received: \d \(quorum 2\)", page.locator("#proofs").inner_text())
                browser.close()
        except (AssertionError, PlaywrightError) as exc:
            logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in tmp_path.glob("*.log"))
            pytest.fail(f"{exc}\n{logs}")
        finally:
            if contributors is not None:
                contributors.stop()
            for process in (server, dashboard):
                if process is not None:
                    stop(process)


@pytest.mark.slow
def test_the_page_shows_a_training_swarms_loss_and_workers_from_its_dht(tmp_path: Path) -> None:
    """The dashboard starts mid-run, after three rounds: its chart still begins at the run's first round."""
    from tests.integration.test_swarm import fail_with_logs, launch, tiny, watch

    start_browser = sync_playwright()
    from playwright.sync_api import Error as PlaywrightError

    swarm = launch(tmp_path, tiny(rounds=40, steps=40), ["head", "body1", "tail"])
    dashboard = None
    try:
        asyncio.run(watch(swarm, lambda s: s.step >= 3, 240))
        dashboard = start_process(["dashboard", *swarm.target, "--run-id", swarm.run_id(), "--initial-peer",
                                   swarm.peer, "--port", "0"], tmp_path / "dashboard.log")
        url = dashboard_url(dashboard)
        with start_browser() as playwright:
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1280, "height": 860}, bypass_csp=True)
            page.goto(url)
            page.wait_for_function("document.querySelectorAll('#loss-chart polyline').length === 1 && "
                                   "document.getElementById('loss-chart').textContent.includes('5 rounds')",
                                   timeout=240_000)
            chart = page.locator("#loss-chart").text_content() or ""
            assert "e0 r1" in chart, f"the chart does not start at the run's first round: {chart}"
            ticks = page.locator("#loss-chart text.tick").all_text_contents()
            assert len(ticks) >= 2 and all(re.fullmatch(r"\d+(\.\d+)?", t) for t in ticks), ticks
            assert re.fullmatch(r"last loss \d+\.\d{4} \(epoch 0, round \d+\)", page.locator("#last-loss").inner_text())
            assert re.fullmatch(r"\d+ tokens/s", page.locator("#tokens-per-s").inner_text())
            stages = [[cell.inner_text() for cell in row.locator("td").all()]
                      for row in page.locator("#stages tbody tr").all()]
            assert stages == [[name, "1", "1", "0", "0"] for name in ("head", "body1", "tail")], stages
            totals = [int(row.locator("td").nth(5).inner_text()) for row in page.locator("#leaderboard tbody tr").all()]
            assert len(totals) == 4 and all(t > 0 for t in totals), totals
            if os.environ.get("PSYSWARM_SCREENSHOT"):
                page.screenshot(path=os.environ["PSYSWARM_SCREENSHOT"], full_page=True)
            browser.close()
    except (AssertionError, PlaywrightError, TimeoutError, RuntimeError) as exc:
        fail_with_logs(swarm, exc)
    finally:
        if dashboard is not None:
            stop(dashboard)
        swarm.stop()
