"""collab_kit.live_view: the join notebook's figure, drawn from real epoch records."""
from collab_kit.live_view import LiveView
from collab_kit.volunteer import EpochRecord


def records():
    return [EpochRecord(epoch=e, loss=5.0 - 0.5 * e, local_steps=4, samples=32 + 16 * e, averaged=e != 1,
                        group_size=1 if e == 1 else 3, num_peers=3 + (e > 2), seconds=1.0) for e in range(5)]


def test_the_view_draws_loss_peers_and_contribution():
    view = LiveView(target_batch_size=256, title="run 'x'")
    assert not view._display  # outside a notebook nothing is shown, only kept
    assert view.caption() == "waiting for the first global epoch..."
    for record in records():
        view.update(record)
    assert view.contributed_samples == sum(r.samples for r in records())
    assert view.caption() == ("epoch 4: loss 3.000, 4 peer(s) in the swarm; you contributed 320 samples in 5 "
                              "epoch(s), 38% of the swarm's last batch")
    loss_ax, peers_ax, share_ax = view.figure().axes
    assert list(loss_ax.lines[0].get_ydata()) == [5.0, 4.5, 4.0, 3.5, 3.0]
    # grey for the lone epoch, green for the averaged ones
    assert sorted(len(c.get_offsets()) for c in loss_ax.collections) == [1, 4]
    assert [line.get_label() for line in peers_ax.lines] == ["in the swarm", "averaged with you"]
    assert list(peers_ax.lines[1].get_ydata()) == [3, 1, 3, 3, 3]
    assert [bar.get_height() for bar in share_ax.patches] == [32, 48, 64, 80, 96]
    assert share_ax.lines[0].get_ydata()[0] == 256  # the swarm's batch, as a dashed line
    assert view.png().startswith(b"\x89PNG")
