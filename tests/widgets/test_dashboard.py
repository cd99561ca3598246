"""The dashboard: plots and leaderboard from a monitor database, a static page, and that page in a real browser.

The database is written the way the monitor writes it (RunHistory.record of summarized PeerMetrics
records, tests/helpers/example_history.py). The page is opened in headless Chromium (Debian's package; `make
test` installs it where missing): the screenshot must show each embedded plot, pixel for pixel where
the browser laid it out, and one stripe per leaderboard row; the browser's DOM must hold every
contributor's name as text (names come from peers: none may become markup).
"""

import base64
import io
import os
import re
import subprocess
import sys
from html.parser import HTMLParser

import numpy as np
import pytest
from example_history import NAMES, START, write_example_history
from headless_chromium import chromium, run_chromium  # noqa: F401 (chromium: a fixture)
from PIL import Image

from collab_kit.roles.run_history import RunHistory
from collab_kit.swarm.metrics import PeerMetrics, summarize
from collab_kit.widgets import dashboard
from collab_kit.widgets.dashboard import COLORS, PLOT_DPI, PLOT_SIZE

TITLE = "Test run <b>bold</b>"
# the leaderboard's row backgrounds (dashboard.TABLE_STYLE) and its header's
ODD_STRIPE, EVEN_STRIPE, HEADER = (0xE6, 0xEE, 0xFA), (0xCF, 0xDC, 0xF2), (0x24, 0x32, 0x4A)
WINDOW = (1400, 1600)  # the whole example page fits: Chromium's --screenshot captures the window


class Page(HTMLParser):
    """What a page holds: its tags, the text of each table's cells, its images' sources, its title."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.tags, self.images, self.cells, self.title = [], {}, {}, ""
        self._table, self._cell, self._in_title = None, None, False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        if tag == "img":
            self.images[attrs.get("id")] = attrs.get("src", "")
        elif tag == "table":
            self._table = attrs.get("class", "").split()[-1]
            self.cells[self._table] = []
        elif tag == "tr" and self._table:
            self.cells[self._table].append([])
        elif tag == "td" and self._table:
            self._cell = ""
        elif tag == "title":
            self._in_title = True

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None:
            self.cells[self._table][-1].append(self._cell)
            self._cell = None
        elif tag == "table":
            self._table = None
        elif tag == "title":
            self._in_title = False

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data
        if self._in_title:
            self.title += data

    def rows(self, table: str) -> list:
        return [row for row in self.cells.get(table, []) if row]  # the header row has th cells only


def decode_png(src: str) -> np.ndarray:
    prefix = "data:image/png;base64,"
    assert src.startswith(prefix), src[:60]
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(src[len(prefix) :]))).convert("RGB"))


def rgb(colour: str) -> np.ndarray:
    return np.array([int(colour[i : i + 2], 16) for i in (1, 3, 5)])


def colour_mask(image: np.ndarray, colour) -> np.ndarray:
    return np.all(image == np.asarray(colour), axis=-1)


def find_plot(screenshot: np.ndarray, plot: np.ndarray, colour: str) -> bool:
    """Whether ``plot`` appears in the screenshot, pixel for pixel.

    Each plot is the only thing on the page drawn in its colour: the corner of the box around that
    colour's pixels places the plot in the screenshot, and the whole plot must then be there.
    """
    in_plot, in_screenshot = colour_mask(plot, rgb(colour)), colour_mask(screenshot, rgb(colour))
    if not in_screenshot.any():
        return False
    (plot_y, plot_x), (shot_y, shot_x) = np.argwhere(in_plot).min(0), np.argwhere(in_screenshot).min(0)
    top, left = shot_y - plot_y, shot_x - plot_x
    height, width = plot.shape[:2]
    if top < 0 or left < 0 or top + height > screenshot.shape[0] or left + width > screenshot.shape[1]:
        return False
    region = screenshot[top : top + height, left : left + width]
    return bool(np.all(region == plot, axis=-1).mean() > 0.99)


def stripes(screenshot: np.ndarray, min_pixels: int = 300) -> list:
    """The leaderboard's rows as the screenshot shows them: the heights of alternating stripe bands, top down."""
    bands = []
    for y in range(screenshot.shape[0]):
        line = screenshot[y]
        label = (
            "odd"
            if colour_mask(line, ODD_STRIPE).sum() >= min_pixels
            else "even"
            if colour_mask(line, EVEN_STRIPE).sum() >= min_pixels
            else None
        )
        if label is None:
            continue
        if bands and bands[-1][0] == label and bands[-1][2] == y - 1:
            bands[-1][1] += 1
            bands[-1][2] = y
        else:
            bands.append([label, 1, y])
    return [(label, height) for label, height, _ in bands]


# -- Chromium ---------------------------------------------------------------------------------


def screenshot(binary: str, workdir, html_path) -> np.ndarray:
    png = os.path.join(workdir, f"screenshot_{os.path.basename(html_path)}.png")
    run_chromium(
        binary,
        workdir,
        f"--screenshot={png}",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
        f"file://{os.path.abspath(html_path)}",
    )
    image = np.asarray(Image.open(png).convert("RGB"))
    assert image.shape[:2] == (WINDOW[1], WINDOW[0]), image.shape
    return image


# -- fixtures ---------------------------------------------------------------------------------


def run_cli(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "collab_kit.cli", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def example_db(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("monitor") / "run.sqlite")
    expected = write_example_history(path)
    return path, expected


@pytest.fixture(scope="module")
def cli_page(example_db):
    """The page `collab-kit dashboard` writes (default --out: dashboard.html beside the database)."""
    db_path, _ = example_db
    result = run_cli("dashboard", "--db", db_path, "--title", TITLE)
    out_path = os.path.join(os.path.dirname(db_path), "dashboard.html")
    return result, out_path


# -- tests ------------------------------------------------------------------------------------


def test_durations_and_leaderboard_rows():
    assert [dashboard.format_duration(s) for s in (0, 44.6, 185, 7620, 3 * 86400 + 3600 * 5 + 59)] == [
        "0 s",
        "45 s",
        "3 min 05 s",
        "2 h 07 min",
        "3 d 5 h",
    ]
    assert dashboard.format_time(START) == "2023-11-14 22:13:20 UTC"
    from collab_kit.roles.run_history import Contributor

    rows = dashboard.leaderboard_rows(
        [Contributor("a", 300, 7620.0, START, START + 60), Contributor("b", 100, 44.6, START + 30, START + 60)]
    )
    assert [(r.rank, r.name, r.samples, r.share, r.compute) for r in rows] == [
        (1, "a", 300, 0.75, "2 h 07 min"),
        (2, "b", 100, 0.25, "45 s"),
    ]
    assert rows[1].first_seen == "2023-11-14 22:13:50 UTC"


def test_plots_draw_what_the_monitor_recorded(tmp_path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # polls where no peer was alive have no loss: the loss curve skips them, the peer count shows 0
    path = str(tmp_path / "run.sqlite")
    with RunHistory(path) as history:
        for poll in range(6):
            records = (
                []
                if poll in (2, 3)
                else [
                    PeerMetrics(
                        peer_id="12D3KooWPeer0",
                        epoch=poll,
                        samples_per_second=10.0 + poll,
                        samples_accumulated=100 * poll,
                        loss=5.0 - poll,
                        mini_steps=4,
                        compute_seconds=10.0 * poll,
                        time=START + poll,
                    )
                ]
            )
            history.record(summarize(records, now=START + 10 * poll), [(b"key", r, r.peer_id) for r in records])
    series = dashboard.load(path).series
    loss_ax, peers_ax, throughput_ax, epoch_ax = Figure().subplots(4, 1)
    dashboard.plot_loss(loss_ax, series)
    dashboard.plot_alive_peers(peers_ax, series)
    dashboard.plot_throughput(throughput_ax, series)
    dashboard.plot_loss(epoch_ax, series, x="epoch")
    assert list(loss_ax.lines[0].get_ydata()) == [5.0, 4.0, 1.0, 0.0]
    assert list(epoch_ax.lines[0].get_xdata()) == [0, 1, 4, 5] and epoch_ax.get_xlabel() == "global epoch"
    assert list(peers_ax.lines[0].get_ydata()) == [1, 1, 0, 0, 1, 1]
    assert list(throughput_ax.lines[0].get_ydata()) == [10.0, 11.0, 0.0, 0.0, 14.0, 15.0]
    with pytest.raises(ValueError, match="expected one of"):
        dashboard.plot_loss(loss_ax, series, x="step")
    # every axis says what it counts, in which unit; epochs and peers are whole numbers
    figure = loss_ax.figure
    FigureCanvasAgg(figure).draw()
    assert loss_ax.get_ylabel() == epoch_ax.get_ylabel() == "loss (nats per token)"
    assert peers_ax.get_ylabel() == "peers" and throughput_ax.get_ylabel() == "samples/s"
    for axis in (epoch_ax.xaxis, peers_ax.yaxis):
        labels = [label.get_text().replace("\u2212", "-") for label in axis.get_ticklabels() if label.get_text()]
        assert labels and all(label.lstrip("-").isdigit() for label in labels), labels


def test_cli_writes_a_page_with_plots_leaderboard_and_latest_figures(cli_page, example_db):
    result, out_path = cli_page
    assert result.returncode == 0, result.stderr
    assert f"dashboard written to {out_path}" in result.stdout
    assert "epoch 23, 5 alive peers, 91.3 samples/s" in result.stdout and "5 contributors" in result.stdout
    text = open(out_path, encoding="utf-8").read()
    page = Page(text)
    # names from peers stay text: no script, no image but the three plots, the title as given
    assert "script" not in page.tags and page.tags.count("img") == 3 and page.tags.count("b") == 0
    assert page.title == TITLE and "&lt;script&gt;" in text and "&amp;amp;" in text
    assert [row[1] for row in page.rows("leaderboard")] == list(NAMES)
    alice = page.rows("leaderboard")[0]
    assert alice == [
        "1",
        "alice",
        "28,800",
        "48.6%",
        "10 min 48 s",
        "Tesla T4, fp16",
        "2023-11-14 22:13:19 UTC",
        "2023-11-14 22:24:49 UTC",
    ]
    # the latest figures, the checkpoints, when it was made
    for figure in ("global epoch", "alive peers", "samples/s", "91.3", "1.2182", "59,240"):
        assert figure in text, figure
    assert [row[:2] for row in page.rows("checkpoints")] == [
        ["8", "monitor/checkpoints/epoch-000008"],
        ["16", "monitor/checkpoints/epoch-000016"],
    ]
    assert re.search(r"Generated \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", text)
    # each plot is a real PNG of the plot's size with its curve in it
    for kind, colour in COLORS.items():
        image = decode_png(page.images[f"plot-{kind}"])
        assert image.shape == (PLOT_SIZE[1] * PLOT_DPI, PLOT_SIZE[0] * PLOT_DPI, 3)
        assert colour_mask(image, rgb(colour)).sum() > 300, f"the {kind} plot has no curve"


def test_an_empty_database_gives_a_page_that_says_so(tmp_path):
    db_path, out_path = str(tmp_path / "run.sqlite"), str(tmp_path / "site" / "index.html")
    RunHistory(db_path).close()  # what a monitor leaves before its first poll
    dashboard.write_page(db_path, out_path)
    text = open(out_path, encoding="utf-8").read()
    page = Page(text)
    assert "No polls yet" in text and "collab-kit monitor --db" in text
    assert "No contributors yet" in text and "No checkpoints yet" in text and "img" not in page.tags
    assert "No polls yet" in dashboard.load(db_path).summary()


def test_the_dashboard_reads_a_database_the_monitor_is_writing(tmp_path):
    path = str(tmp_path / "run.sqlite")
    with RunHistory(path) as monitor:  # the monitor's connection stays open, in WAL mode, as while it runs
        for poll in range(3):
            monitor.record(summarize([], now=START + poll), [])
            assert len(dashboard.load(path).series) == poll + 1  # each committed poll is seen at once
        dashboard.write_page(path, str(tmp_path / "page.html"))
        monitor.record(summarize([], now=START + 3), [])  # the reader left nothing locked
    assert Page((tmp_path / "page.html").read_text()).tags.count("img") == 3


def test_the_page_shows_each_anchor_live_or_gone(tmp_path):
    import sqlite3

    path = str(tmp_path / "run.sqlite")
    monitor_anchor = ["/ip4/10.77.0.10/tcp/31337/p2p/QmMonitorAnchor"]
    second_anchor = ["/ip4/10.77.0.11/tcp/4000/p2p/QmSecondAnchor", "/ip4/10.77.0.11/udp/4000/quic/p2p/QmSecondAnchor"]
    with RunHistory(path) as history:  # as the monitor records each poll: the anchors it read, then the swarm
        history.record_anchors([monitor_anchor, second_anchor], START)
        history.record(summarize([], now=START), [])
        history.record_anchors([monitor_anchor], START + 600)  # the second anchor's record expired: it died
        history.record(summarize([], now=START + 600), [])
    data = dashboard.load(path)
    assert [(a.peer_id, a.addresses) for a in data.anchors] == [
        ("QmMonitorAnchor", monitor_anchor),
        ("QmSecondAnchor", second_anchor),
    ]
    text = dashboard.render_page(data)
    rows = re.findall(r'<tr class="(live|gone)"><td class="name">(\w+)</td><td>([^<]*)</td>', text)
    assert [(state, peer) for state, peer, _ in rows] == [("live", "QmMonitorAnchor"), ("gone", "QmSecondAnchor")]
    assert rows[1][2] == f"gone since {dashboard.format_time(START)}" and second_anchor[1] in text
    # a database written before anchors were kept: none, and no error
    old = str(tmp_path / "old.sqlite")
    connection = sqlite3.connect(old)
    connection.executescript(
        "CREATE TABLE swarm (time REAL NOT NULL, epoch INTEGER NOT NULL, loss REAL, "
        "alive_peers INTEGER NOT NULL, samples_per_second REAL NOT NULL);"
    )
    connection.close()
    with RunHistory(old, read_only=True) as history:
        assert history.anchors() == []


def test_a_missing_database_says_how_to_get_one(tmp_path):
    missing = str(tmp_path / "nowhere" / "run.sqlite")
    with pytest.raises(FileNotFoundError, match=r"collab-kit monitor --db"):
        dashboard.load(missing)
    result = run_cli("dashboard", "--db", missing, "--out", str(tmp_path / "page.html"))
    assert result.returncode == 2 and "collab-kit monitor --db" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "page.html").exists()

    not_a_db = tmp_path / "notes.sqlite"
    not_a_db.write_text("not a database")
    with pytest.raises(ValueError, match="is not a monitor database"):
        dashboard.load(str(not_a_db))


def test_chromium_renders_every_plot_and_every_leaderboard_row(chromium, cli_page, tmp_path):
    _, page_path = cli_page
    page = Page(open(page_path, encoding="utf-8").read())
    shot = screenshot(chromium, tmp_path, page_path)
    for kind, colour in COLORS.items():
        assert find_plot(shot, decode_png(page.images[f"plot-{kind}"]), colour), f"the {kind} plot is not on screen"
    bands = stripes(shot)
    assert [label for label, _ in bands] == ["odd", "even", "odd", "even", "odd"], bands
    assert all(height >= 15 for _, height in bands), f"rows too thin to hold text: {bands}"
    assert colour_mask(shot, HEADER).sum() > 5000, "the tables' header rows are not on screen"

    # what the browser built from the page: every name as text, no element made from one
    dom = Page(run_chromium(chromium, tmp_path, "--dump-dom", f"file://{page_path}"))
    assert [row[1] for row in dom.rows("leaderboard")] == list(NAMES)
    assert "script" not in dom.tags and dom.tags.count("img") == 3 and dom.title == TITLE


def test_the_screenshot_check_catches_a_broken_image(chromium, cli_page, tmp_path):
    _, page_path = cli_page
    text = open(page_path, encoding="utf-8").read()
    page = Page(text)
    src = page.images["plot-loss"]
    start = len(src) // 3  # a third of the PNG's data overwritten: the browser cannot draw that plot
    broken_path = tmp_path / "broken.html"
    broken_path.write_text(text.replace(src, src[:start] + "A" * (len(src) // 3) + src[start + len(src) // 3 :]))
    shot = screenshot(chromium, tmp_path, broken_path)
    assert not find_plot(shot, decode_png(src), COLORS["loss"])
    for kind in ("alive_peers", "throughput"):
        assert find_plot(shot, decode_png(page.images[f"plot-{kind}"]), COLORS[kind]), kind


def test_without_a_path_the_dashboard_reads_the_monitors_database_else_the_demos(tmp_path, monkeypatch):
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / "notebooks")
    with pytest.raises(FileNotFoundError, match=r"DB_PATH in the dashboard notebook.*make demo"):
        dashboard.load()
    (tmp_path / "demo_out").mkdir()
    RunHistory(str(tmp_path / "demo_out" / "monitor.sqlite")).close()
    # a notebook runs in notebooks/: make demo's run is one folder up
    assert dashboard.load().db_path == os.path.join("..", "demo_out", "monitor.sqlite")
    monkeypatch.chdir(tmp_path)
    assert dashboard.load().db_path == os.path.join("demo_out", "monitor.sqlite")  # what `make demo` leaves
    (tmp_path / "monitor").mkdir()
    RunHistory(str(tmp_path / "monitor" / "run.sqlite")).close()
    assert dashboard.load("").db_path == os.path.join("monitor", "run.sqlite")  # a monitor's own comes first
