"""Fragments (Streaming DiLoCo's staggered synchronization) in the local-update mode: ``OptimizerConfig.fragments``.

F contiguous fragments of about equal size; the round ending epoch ``e`` (H / F global batches) averages fragment
``e % F`` alone, so each round carries a F-th of the bytes, and its outer step moves that fragment alone.

- ``fragment_of_tensors``: which fragment each parameter belongs to (the same on every peer: the model's shapes).
- ``FragmentRoundsMixin``, in front of a gradient averager: a round all-reduces only the fragment of the group's
  epoch (``RoundResult.epoch``), the same for every member.
- ``FragmentStepMixin``, in front of the state averager: a step copies into the model only the fragment it stepped
  (``step_fragment``); a download still copies everything.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeAlias

import torch

from collab_kit.swarm.averagers import RoundResult

if TYPE_CHECKING:  # the type checker's view: what FragmentRoundsMixin is put before
    from hivemind.averaging import DecentralizedAverager

    _AveragerBase: TypeAlias = DecentralizedAverager
else:
    _AveragerBase = object

logger = logging.getLogger(__name__)


def fragment_of_tensors(sizes: Sequence[int], fragments: int) -> tuple[int, ...]:
    """The fragment (0 .. ``fragments`` - 1) of each tensor of ``sizes`` (their numbers of elements, in order):
    contiguous runs of about ``total / fragments`` elements each, none empty while there are as many tensors as
    fragments (tests/swarm/test_fragments.py::test_fragments_are_contiguous_even_and_never_empty)."""
    total, before, current, assignment = max(1, sum(sizes)), 0, 0, []
    for index, size in enumerate(sizes):
        # the fragment of the tensor's middle element, one step at a time, so that no fragment is skipped ...
        wanted = min(fragments - 1, int(fragments * (before + size / 2) / total))
        current = min(max(current, wanted), current + (index > 0))
        # ... and the last tensors fill the fragments still empty
        current = max(current, fragments - (len(sizes) - index))
        assignment.append(min(current, fragments - 1))
        before += size
    return tuple(assignment)


def round_fragment(epoch: int | None, fragments: int) -> int:
    """The fragment the round ending ``epoch`` averages (0 when its epoch is unknown)."""
    return (epoch or 0) % fragments


class FragmentRoundsMixin(_AveragerBase):
    """Put before a gradient averager of a peer in local-update mode with ``fragments`` > 1: each round all-reduces
    the tensors of its epoch's fragment alone; the others stay as they were (this peer's own pseudo-gradients, which
    the outer step leaves out: collab_kit.swarm.local_updates)."""

    fragments = 1  # set by compose_averager: the run's OptimizerConfig.fragments

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info, group_id=None, **kwargs):
        members = {}
        for peer_id, entry in zip(group_info.peer_ids, group_info.gathered):
            user_bytes = self.serializer.loads(entry)[2]
            members[peer_id] = self.serializer.loads(user_bytes)
        fragment = round_fragment(RoundResult(members).epoch(), self.fragments)
        assignment = fragment_of_tensors([tensor.numel() for tensor in tensors], self.fragments)
        chosen = [tensor for tensor, owner in zip(tensors, assignment) if owner == fragment]
        return await super()._run_allreduce_inplace_(chosen, group_info, group_id, **kwargs)


def fragment_rounds_mixin(fragments: int) -> type:
    """FragmentRoundsMixin for ``fragments``, whose RPC prefix names them: peers of different F never meet."""
    return type(
        f"Fragments{fragments}RoundsMixin",
        (FragmentRoundsMixin,),
        {"__module__": __name__, "fragments": fragments, "rpc_name_prefix": f"Fragments{fragments}"},
    )


class FragmentStepMixin:
    """Put before the state averager of a peer in local-update mode with fragments: while ``step_fragment`` is set
    (a mask over the parameters, by the optimizer's order), the global parameters copied into the model after a step
    are that fragment's alone; the model's others keep the progress of their inner steps."""

    step_fragment: Sequence[bool] | None = None

    @torch.no_grad()
    def _apply_optimizer_parameters_(self):
        if self.step_fragment is None:
            return super()._apply_optimizer_parameters_()
        offloaded = [param for group in self.optimizer.param_groups for param in group["params"]]
        for in_fragment, main_param, global_param in zip(self.step_fragment, self.main_parameters, offloaded):
            if in_fragment:
                main_param.copy_(global_param, non_blocking=True)
