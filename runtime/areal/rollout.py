"""The rollout side of AReaL's ``TrainEngine`` API on ``DTATrainEngine``: the connection to
an inference engine, weight updates and version bookkeeping."""
from __future__ import annotations

from areal.api.io_struct import WeightUpdateMeta

__all__ = ["RolloutMixin"]


class RolloutMixin:
    """``connect_engine``, ``update_weights``, ``rollout_batch``, ``prepare_batch``,
    ``set_version`` / ``get_version``."""

    _version = 0

    def connect_engine(self, engine, meta: WeightUpdateMeta):
        raise NotImplementedError(
            "DTATrainEngine does not drive an inference engine (SGLang/vLLM): run the rollout "
            "with AReaL's inference engine and hand the batches to train_batch / "
            "PPOActor.ppo_update; move weights through disk with "
            "save(SaveLoadMeta(path, 'hf', with_optim=False)) and the inference engine's "
            "update_weights_from_disk")

    def update_weights(self, meta: WeightUpdateMeta):
        raise NotImplementedError(
            "DTATrainEngine has no connected inference engine to push weights to (xccl or "
            "disk); save the weights in HF format with save() and load them on the server")

    def rollout_batch(self, data, workflow, workflow_kwargs=None, group_size: int = 1):
        raise NotImplementedError("DTATrainEngine does not run rollouts; use AReaL's "
                                  "inference engine (e.g. RemoteSGLangEngine.rollout_batch)")

    def prepare_batch(self, dataloader, workflow, workflow_kwargs=None, should_accept_fn=None,
                      group_size: int = 1, dynamic_bs: bool = False):
        raise NotImplementedError("DTATrainEngine does not run rollouts; use AReaL's "
                                  "inference engine (e.g. RemoteSGLangEngine.prepare_batch)")

    def set_version(self, version: int):
        self._version = int(version)

    def get_version(self) -> int:
        return self._version
