"""A volunteer whose training goes nan, for the fault tests (tests/roles/test_faults.py).

Run as ``python tests/helpers/nan_peer.py [--nan-at-epoch E] [--nan-at-step K] [--what parameters|loss] [--steps N]
join OPTIONS...``: the same peer as ``collab-kit join OPTIONS...``, except that its first local training
step at global epoch E or later that is its K-th step or later goes wrong:

- ``--what parameters`` (default): the token embedding is filled with nan before that step's forward
  pass, as a numerical blow-up or a memory fault would leave it; every loss after it is nan until the
  peer loads sound parameters from somewhere;
- ``--what loss``: that step's loss (and the ``N - 1`` next ones) is multiplied by nan, the parameters
  are left alone;
- ``--what overflow``: that step's gradients come out infinite (a hook on its loss multiplies the gradient
  flowing back by inf), as an fp16 step whose scaled gradients overflow does; its loss stays finite.

It prints ``@event {"type": "fault", ...}`` when it does. Nothing of this is in collab_kit: the
fault is injected here, by patching the model's forward pass in this process only.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

from collab_kit.roles.processes import PeerProcess

SCRIPT = os.path.abspath(__file__)


def start_nan_peer(
    name: str,
    args: list[str],
    log_path: str,
    at_epoch: int = 0,
    at_step: int = 1,
    what: str = "parameters",
    steps: int = 1,
) -> PeerProcess:
    """Start it as a subprocess (events, deadlines, kill of its whole process group as for any test peer);
    ``args`` are those of ``collab-kit`` (``["join", "--preset", "tiny", ...]``)."""
    from byzantine_peer import ScriptPeerProcess

    return ScriptPeerProcess(
        name,
        SCRIPT,
        ["--nan-at-epoch", str(at_epoch), "--nan-at-step", str(at_step), "--what", what, "--steps", str(steps), *args],
        log_path,
    )


def main(argv: list[str]) -> int:
    import torch

    from collab_kit.cli import join
    from collab_kit.cli import main as collab_kit_main
    from collab_kit.model.transformer import TextToImageTransformer, initial_model
    from collab_kit.roles.processes import emit_event
    from collab_kit.roles.volunteer import Volunteer

    parser = argparse.ArgumentParser(prog="nan_peer.py")
    parser.add_argument("--nan-at-epoch", type=int, default=0, help="the global epoch at which a step goes wrong")
    parser.add_argument("--nan-at-step", type=int, default=1, help="and not before this local step")
    parser.add_argument("--what", choices=("parameters", "loss", "overflow"), default="parameters")
    parser.add_argument("--steps", type=int, default=1, help="with --what loss: steps in a row with a nan loss")
    options, rest = parser.parse_known_args(argv)
    if not rest or rest[0] != "join":
        parser.error(
            "expected: [--nan-at-epoch E] [--nan-at-step K] [--what parameters|loss] [--steps N] join OPTIONS..."
        )

    class FaultyTransformer(TextToImageTransformer):
        """The run's model, whose training step goes nan once it reaches the chosen epoch and step."""

        volunteer = None  # set once the volunteer is built: the epoch is its
        calls, faulty = 0, []  # local training steps so far; the steps that went wrong

        def forward(self, *args, **kwargs):
            if not self.training:  # sampling, checkpoints: untouched
                return super().forward(*args, **kwargs)
            self.calls += 1
            step, epoch = self.calls, self.volunteer.local_epoch
            if len(self.faulty) < (options.steps if options.what == "loss" else 1) and (
                self.faulty or (epoch >= options.nan_at_epoch and step >= options.nan_at_step)
            ):
                self.faulty.append(step)
                emit_event("fault", what=options.what, step=step, epoch=epoch)
                if options.what == "parameters":
                    with torch.no_grad():
                        self.text_embedding.weight.fill_(float("nan"))
                elif options.what == "overflow":
                    output = super().forward(*args, **kwargs)
                    output.loss.register_hook(lambda grad: grad * float("inf"))
                    return output
                else:
                    output = super().forward(*args, **kwargs)
                    output.loss = output.loss * float("nan")
                    return output
            return super().forward(*args, **kwargs)

    def make_volunteer(config, **kwargs):
        # the volunteer's model seam: the run's initial parameters, in the faulty class
        model = initial_model(config.model, config.swarm.run_id, model_class=FaultyTransformer)
        volunteer = Volunteer.from_config(config, model=model, **kwargs)
        model.volunteer = volunteer
        return volunteer

    print(
        f"nan peer: a step at epoch {options.nan_at_epoch} or later, step {options.nan_at_step} or later, goes "
        f"nan ({options.what})",
        flush=True,
    )
    return collab_kit_main(rest, handlers={"join": functools.partial(join.run, make_volunteer=make_volunteer)})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
