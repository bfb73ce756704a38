"""``rlite.api.BackendWrapper`` hands every member of the training-backend contract on to its inner backend, so
a wrapper overrides only what it changes; it forwards the contract and nothing else."""

from __future__ import annotations

import inspect

import pytest
import torch

from rlite.api import (
    BackendCapabilities,
    BackendWrapper,
    DataLayout,
    ForwardSpec,
    LoraAdapter,
    TrainingBackend,
)

SPEC = ForwardSpec(micro_batch_size=4, temperature=1.0, chunk_size=8, exact_layout=False)


class RecordingBackend:
    """A backend that records every call it receives (and returns something recognisable)."""

    capabilities = BackendCapabilities(lora=True, critic=True)

    def __init__(self) -> None:
        self.model = torch.nn.Linear(2, 2)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.5)
        self.skipped_steps = 0
        self.calls: list[tuple] = []
        self.extra = "only the inner backend has this"

    def _record(self, *call):
        self.calls.append(call)
        return call

    def logprobs(self, batch, spec, *, with_entropy=False):
        return self._record("logprobs", batch, spec, with_entropy)

    def backward(self, loss):
        self._record("backward", loss)

    def step(self, before_step=None, *, skip=False):
        self._record("step", before_step, skip)
        self.skipped_steps += skip
        return 1.5

    def current_lr(self):
        return self._record("current_lr")

    def data_layout(self):
        self._record("data_layout")
        return DataLayout.whole_world()

    def train_mode(self):
        self._record("train_mode")

    def full_weights(self, *, views=False):
        self._record("full_weights", views)
        return iter([("w", torch.zeros(1))])

    def lora_adapter(self):
        self._record("lora_adapter")
        return LoraAdapter(iter([]), {"r": 2})

    def hf_config(self):
        return self._record("hf_config")

    def checkpoint_state(self):
        return {"model": self._record("checkpoint_state")}

    def load_checkpoint_state(self, state):
        self._record("load_checkpoint_state", state)

    def lr_scheduler_state(self):
        return {"scheduler": self._record("lr_scheduler_state")}

    def load_lr_scheduler_state(self, state):
        self._record("load_lr_scheduler_state", state)

    def after_checkpoint(self):
        self._record("after_checkpoint")

    def build_reference(self):
        return self._record("build_reference")

    def build_critic(self, cfg):
        return self._record("build_critic", cfg)

    def device_bytes_to_come(self):
        self._record("device_bytes_to_come")
        return 123

    def close(self):
        self._record("close")


def contract_members() -> list[str]:
    """Every method and attribute the ``TrainingBackend`` protocol names."""
    methods = [n for n, v in vars(TrainingBackend).items() if inspect.isfunction(v) and not n.startswith("_")]
    return methods + list(TrainingBackend.__annotations__)


def test_the_wrapper_defines_every_member_of_the_contract() -> None:
    """So a member added to the contract cannot be forgotten here (there is no ``__getattr__`` to hide it)."""
    members = contract_members()
    assert {"logprobs", "step", "full_weights", "build_critic", "capabilities", "model", "optimizer"} <= set(members)
    assert [m for m in members if m not in vars(BackendWrapper)] == []
    assert "__getattr__" not in vars(BackendWrapper)


def test_every_contract_call_reaches_the_inner_backend() -> None:
    inner = RecordingBackend()
    wrapper = BackendWrapper(inner)
    assert isinstance(wrapper, TrainingBackend)
    assert wrapper.capabilities is inner.capabilities
    assert wrapper.model is inner.model and wrapper.optimizer is inner.optimizer
    batch, hook, loss, state = object(), (lambda: None), torch.ones(()), {"model": 1}
    assert wrapper.logprobs(batch, SPEC, with_entropy=True) == ("logprobs", batch, SPEC, True)
    wrapper.backward(loss)
    assert wrapper.step(hook) == 1.5 and wrapper.step(hook, skip=True) == 1.5
    assert wrapper.skipped_steps == inner.skipped_steps == 1  # read through
    assert wrapper.current_lr() == ("current_lr",)
    assert wrapper.data_layout() == DataLayout.whole_world()
    wrapper.train_mode()
    assert [name for name, _ in wrapper.full_weights(views=True)] == ["w"]
    assert wrapper.lora_adapter().config == {"r": 2}
    assert wrapper.hf_config() == ("hf_config",)
    assert wrapper.checkpoint_state() == {"model": ("checkpoint_state",)}
    wrapper.load_checkpoint_state(state)
    assert wrapper.lr_scheduler_state() == {"scheduler": ("lr_scheduler_state",)}
    wrapper.load_lr_scheduler_state(state)
    wrapper.after_checkpoint()
    assert wrapper.build_reference() == ("build_reference",)
    assert wrapper.build_critic("cfg") == ("build_critic", "cfg")
    assert wrapper.device_bytes_to_come() == 123
    wrapper.close()
    assert [call[0] for call in inner.calls] == [
        "logprobs", "backward", "step", "step", "current_lr", "data_layout", "train_mode", "full_weights",
        "lora_adapter", "hf_config", "checkpoint_state", "load_checkpoint_state", "lr_scheduler_state",
        "load_lr_scheduler_state", "after_checkpoint", "build_reference", "build_critic", "device_bytes_to_come",
        "close",
    ]  # fmt: skip
    assert inner.calls[1][1] is loss and inner.calls[7][1] is True
    assert inner.calls[2][1:] == (hook, False) and inner.calls[3][1:] == (hook, True)
    assert inner.calls[11][1] is state and inner.calls[13][1] is state


def test_a_step_without_skip_reaches_a_backend_whose_step_has_no_skip() -> None:
    """The loop passes ``skip`` only when it is set, so a backend's ``step(before_step)`` works on finite
    updates; through the wrapper too."""

    class PlainStep(RecordingBackend):
        def step(self, before_step=None):
            self._record("step", before_step)
            return 2.0

    assert BackendWrapper(PlainStep()).step(None) == 2.0


def test_a_subclass_overrides_only_what_it_changes() -> None:
    class CountingBackend(BackendWrapper):
        def __init__(self, inner):
            super().__init__(inner)
            self.steps = 0

        def step(self, before_step=None, *, skip=False):
            self.steps += 1
            return super().step(before_step, skip=skip)

    inner = RecordingBackend()
    wrapper = CountingBackend(inner)
    assert wrapper.step() == 1.5 and wrapper.steps == 1 and inner.calls == [("step", None, False)]
    assert wrapper.current_lr() == ("current_lr",)  # everything else still reaches the inner backend


def test_only_the_contract_is_forwarded_and_an_early_read_is_an_attribute_error() -> None:
    inner = RecordingBackend()
    wrapper = BackendWrapper(inner)
    with pytest.raises(AttributeError, match="extra"):
        wrapper.extra  # noqa: B018  (the inner backend's own: reach it as wrapper.inner.extra)
    assert wrapper.inner.extra == inner.extra

    class Early(BackendWrapper):
        def __init__(self, inner):
            self.seen = hasattr(self, "steps")  # before super().__init__: no inner yet, no recursion either
            super().__init__(inner)

    assert Early(inner).seen is False
    with pytest.raises(AttributeError, match="inner"):
        BackendWrapper.__new__(BackendWrapper).model  # noqa: B018
