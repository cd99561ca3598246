"""collab_kit.widgets.live_view: the join notebook's figure, drawn from real epoch records."""

from collab_kit.roles.records import EpochRecord
from collab_kit.widgets.live_view import LiveView


def records():
    return [
        EpochRecord(
            epoch=e,
            loss=5.0 - 0.5 * e,
            local_steps=4,
            samples=32 + 16 * e,
            averaged=e != 1,
            group_size=1 if e == 1 else 3,
            num_peers=3 + (e > 2),
            seconds=1.0,
        )
        for e in range(5)
    ]


def test_the_view_draws_loss_peers_and_contribution():
    view = LiveView(target_batch_size=256, title="run 'x'")
    assert not view._display  # outside a notebook nothing is shown, only kept
    assert view.caption() == "waiting for the first global epoch..."
    for record in records():
        view.update(record)
    assert view.contributed_samples == sum(r.samples for r in records())
    assert view.caption() == (
        "epoch 4: loss 3.000, 4 peer(s) in the swarm; you contributed 320 samples in 5 "
        "epoch(s), 38% of the swarm's last batch"
    )
    loss_ax, peers_ax, share_ax = view.figure().axes
    assert list(loss_ax.lines[0].get_ydata()) == [5.0, 4.5, 4.0, 3.5, 3.0]
    # grey for the lone epoch, green for the averaged ones
    assert sorted(len(c.get_offsets()) for c in loss_ax.collections) == [1, 4]
    assert [line.get_label() for line in peers_ax.lines] == ["in the swarm", "averaged with you"]
    # the others averaged with this peer: none in the lone epoch (its group was itself alone)
    assert list(peers_ax.lines[1].get_ydata()) == [2, 0, 2, 2, 2]
    assert [bar.get_height() for bar in share_ax.patches] == [32, 48, 64, 80, 96]
    assert share_ax.lines[0].get_ydata()[0] == 256  # the swarm's batch, as a dashed line
    assert view.png().startswith(b"\x89PNG")


def tick_labels(axis, figure):
    figure.canvas.draw()  # tick labels are made when the figure is drawn
    return [label.get_text() for label in axis.get_ticklabels() if label.get_text()]


def is_whole(text: str) -> bool:
    return text.replace("\u2212", "-").lstrip("-").isdigit()


def test_epochs_and_peers_have_whole_ticks_and_every_axis_its_label():
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    for count in (1, 2, 5):  # one epoch is where 0.5 ticks and 1.90-2.10 peer ticks came from
        view = LiveView(target_batch_size=256)
        for record in records()[:count]:
            view.update(record)
        figure = view.figure()
        FigureCanvasAgg(figure)
        loss_ax, peers_ax, share_ax = figure.axes
        for ax in (loss_ax, peers_ax, share_ax):
            labels = tick_labels(ax.xaxis, figure)
            assert labels and all(is_whole(label) for label in labels), (count, labels)
            assert ax.get_xlabel() == "global epoch" and ax.get_ylabel(), ax.get_title()
        peers = tick_labels(peers_ax.yaxis, figure)
        assert peers and all(is_whole(label) for label in peers), (count, peers)
        assert "nats per token" in loss_ax.get_ylabel()


def test_a_lone_peer_is_drawn_alone():
    from collab_kit.roles.records import EpochRecord

    view = LiveView(target_batch_size=256)
    for epoch in range(5):
        view.update(
            EpochRecord(
                epoch=epoch,
                loss=4.0,
                local_steps=4,
                samples=32,
                averaged=False,
                group_size=1,
                num_peers=3,
                seconds=1.0,
                training_peers=3,
            )
        )
    peers_ax = view.figure().axes[1]
    assert list(peers_ax.lines[1].get_ydata()) == [0] * 5  # nobody averaged with it, as its caption says
    assert "TRAINING ALONE" in view.caption()


def test_the_training_plot_has_whole_epoch_ticks_and_units():
    import matplotlib

    matplotlib.use("Agg")
    from collab_kit.roles.records import TrainingHistory

    history = TrainingHistory()
    history.epochs = records()[:2]
    ax = history.plot()
    labels = tick_labels(ax.xaxis, ax.figure)
    assert labels and all(is_whole(label) for label in labels), labels
    assert "nats per token" in ax.get_ylabel() and ax.get_xlabel() == "global epoch"
