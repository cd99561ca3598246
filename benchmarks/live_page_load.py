"""The live page under load: many watchers read the monitor's page and API while the swarm trains.

A monitor (``tiny`` preset, its live page on, a poll every 2 s, a checkpoint every 3 global epochs) and two volunteers
on 127.0.0.1. For a first minute nobody watches; for the next, WATCHERS clients read the API as the page does (the
status once a second with its ETag, the new points of the series) and now and then the page itself and its scripts.
Measured from the monitor's own events: its poll period with and without the watchers (against its setting), the
checkpoints it saved against those that fell due; and from the watchers: every answer's status.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter

from benchmarks import common

WATCHERS = 200
POLL_EVERY = 2.0
CHECKPOINT_EVERY = 3
TARGET_POLL_RATIO = 1.5

TITLE = "The live page under load: 200 watchers while the swarm trains"
HOW = f"""
`collab-kit monitor --preset tiny --dashboard-port 0 --poll-every {POLL_EVERY:g} --checkpoint-every {CHECKPOINT_EVERY}`
and two volunteers on 127.0.0.1 (`collab_kit.roles.services`). A minute with nobody watching, then a minute with
{WATCHERS} watchers (asyncio clients in the benchmark's process, each on its own kept-alive connection): every second
the status with `If-None-Match`, the new points of the series, and every tenth time the page and its two scripts.
Poll period: the mean time between the monitor's `poll` events in each minute, over its setting. Target <=
{TARGET_POLL_RATIO}x with the watchers, no 5xx, and every checkpoint that fell due in the loaded minute saved.
"""


async def _read_answer(reader: asyncio.StreamReader) -> tuple[int, dict, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    headers = {}
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower().decode()] = value.strip().decode()
    length = int(headers.get("content-length", 0))
    body = await reader.readexactly(length) if length else b""
    return status, headers, body


async def _watcher(host: str, port: int, until: float, statuses: Counter, index: int) -> None:
    etag, since, loops = None, None, 0
    reader = writer = None
    while time.monotonic() < until:
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection(host, port)
            targets = ["/api/status", "/api/series" + (f"?since={since}" if since else "")]
            if (loops + index) % 10 == 0:
                targets += ["/", "/page.js", "/vendor/chart.umd.min.js"]
            for target in targets:
                extra = f"If-None-Match: {etag}\r\n" if etag and target == "/api/status" else ""
                writer.write(f"GET {target} HTTP/1.1\r\nHost: page\r\n{extra}\r\n".encode())
                await writer.drain()
                status, headers, body = await _read_answer(reader)
                statuses[status] += 1
                if target == "/api/status" and status == 200:
                    etag = headers.get("etag", etag)
                if target.startswith("/api/series") and status == 200 and body:
                    times = json.loads(body).get("time") or []
                    since = times[-1] if times else since
            loops += 1
        except (OSError, asyncio.IncompleteReadError, ValueError) as e:
            statuses[f"error: {type(e).__name__}"] += 1
            if writer is not None:
                writer.close()
            reader = writer = None
        await asyncio.sleep(1.0)
    if writer is not None:
        writer.close()


async def _watch(url: str, seconds: float, statuses: Counter) -> None:
    host, port = url.split("//")[1].rstrip("/").split(":")
    until = time.monotonic() + seconds
    await asyncio.gather(*(_watcher(host, int(port), until, statuses, i) for i in range(WATCHERS)))


def _poll_period(events: list[dict], start: float, end: float) -> float:
    times = [event["at"] for event in events if event["type"] == "poll" and start <= event["at"] <= end]
    return statistics.mean(b - a for a, b in zip(times, times[1:])) if len(times) > 1 else float("nan")


def _checkpoints(events: list[dict], start: float, end: float) -> tuple[int, int]:
    """(checkpoints that fell due in the window: a multiple of CHECKPOINT_EVERY first polled there, those saved)."""
    first_poll = {}
    for event in events:
        if event["type"] == "poll":
            first_poll.setdefault(event["epoch"], event["at"])
    due = {
        epoch
        for epoch, at in first_poll.items()
        if start <= at <= end - 5 * POLL_EVERY and epoch % CHECKPOINT_EVERY == 0 and epoch > 0
    }
    saved = {event["epoch"] for event in events if event["type"] == "checkpoint"}
    return len(due), len(due & saved)


def run(quick: bool = False) -> list[dict]:
    from collab_kit.config import get_preset
    from collab_kit.roles import services
    from collab_kit.roles.monitor_settings import MonitorSettings

    seconds = 20.0 if quick else 60.0
    folder = tempfile.mkdtemp(prefix="collab_kit_bench_live_page_")
    config = get_preset(
        "tiny",
        swarm=dict(run_id="live_page_load", host="127.0.0.1"),
        optimizer=dict(target_batch_size=512, total_steps=100_000),
        data=dict(shards="synthetic"),
    )
    settings = MonitorSettings(
        db_path=os.path.join(folder, "run.sqlite"),
        checkpoint_dir=os.path.join(folder, "ck"),
        checkpoint_every=CHECKPOINT_EVERY,
        poll_every=POLL_EVERY,
        dashboard_port=0,
    )
    statuses: Counter = Counter()
    try:
        monitor = services.start_monitor(config, settings, log_path=os.path.join(folder, "monitor.log"))
        joining = get_preset(
            "tiny",
            swarm=dict(run_id="live_page_load", host="127.0.0.1", initial_peers=monitor.addresses),
            optimizer=dict(target_batch_size=512, total_steps=100_000),
        )
        volunteers = [
            services.start_volunteer_process(
                joining,
                threads=1,
                wait_for_peers=2,
                name=f"volunteer-{i}",
                log_path=os.path.join(folder, f"volunteer-{i}.log"),
                wait=False,
            )
            for i in range(2)
        ]
        for volunteer in volunteers:
            volunteer.wait_until_ready(180)
        monitor.wait_for_poll(epoch=CHECKPOINT_EVERY, contributors=2, timeout=180)
        quiet_start = time.time()
        monitor.wait_for(
            lambda e: e["type"] == "poll" and e["at"] >= quiet_start + seconds, seconds + 60, "a minute of polls"
        )
        loaded_start = time.time()
        asyncio.run(_watch(monitor.page_url, seconds, statuses))
        loaded_end = time.time()
        events = monitor.events
    except BaseException:
        print(f"  the logs are kept in {folder}", flush=True)
        raise
    finally:
        services.stop_all()
    shutil.rmtree(folder, ignore_errors=True)
    quiet = _poll_period(events, quiet_start, loaded_start) / POLL_EVERY
    loaded = _poll_period(events, loaded_start, loaded_end) / POLL_EVERY
    due, saved = _checkpoints(events, loaded_start, loaded_end)
    errors = sum(count for status, count in statuses.items() if not isinstance(status, int) or status >= 500)
    answered = sum(count for status, count in statuses.items() if isinstance(status, int))
    details = (
        f"poll period over its {POLL_EVERY:g} s setting: {quiet:.2f}x unwatched, {loaded:.2f}x with {WATCHERS} "
        f"watchers; {answered} answers in {seconds:.0f} s ({dict(sorted(statuses.items(), key=str))}); "
        f"checkpoints due in the loaded minute {due}, saved {saved}."
    )
    print(f"  {details}", flush=True)
    return [
        common.make_row(
            __spec__.name,
            f"monitor's poll period with {WATCHERS} page watchers / its setting",
            loaded,
            f"<= {TARGET_POLL_RATIO}",
            f"{loaded:.2f}x",
            details,
        ),
        common.make_row(
            __spec__.name,
            f"5xx answers and failed requests among {WATCHERS} watchers' {answered}",
            float(errors),
            "<= 0",
            str(errors),
            details,
        ),
        common.make_row(
            __spec__.name,
            "checkpoints saved / due while watched",
            saved / due if due else None,
            ">= 1.0",
            f"{saved}/{due}",
            details,
        ),
    ]


if __name__ == "__main__":
    common.main(sys.modules[__name__])
