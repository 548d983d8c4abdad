"""Hugging Face ``Trainer``: ``Trainer(..., callbacks=[StepdoctorCallback(project="p", run="r")])``.

One profiler step per optimizer step (``on_step_end``, the Trainer's own notion of a step, so
gradient accumulation is inside it). The DataLoader's settings (from the loader, completed by the
``dataloader_*`` training arguments) and the arguments that shape a step (batch size, accumulation,
precision, world size) go with every trace. Any :func:`stepdoctor.profile` keyword passes through.
"""

from __future__ import annotations

from typing import Any

try:
    import transformers as _framework
    from transformers import TrainerCallback
except ImportError as exc:
    raise ImportError(
        "stepdoctor.integrations.transformers needs Hugging Face transformers: "
        "pip install 'stepdoctor[transformers]'"
    ) from exc

from stepdoctor.guard import guarded
from stepdoctor.integrations._session import Session, merged_loader_settings

__all__ = ["StepdoctorCallback"]


def _known_loader_settings(args: Any) -> dict[str, Any]:
    return {
        "batch_size": getattr(args, "per_device_train_batch_size", None),
        "num_workers": getattr(args, "dataloader_num_workers", None),
        "pin_memory": getattr(args, "dataloader_pin_memory", None),
        "persistent_workers": getattr(args, "dataloader_persistent_workers", None),
        "prefetch_factor": getattr(args, "dataloader_prefetch_factor", None),
    }


def _trainer_settings(args: Any) -> dict[str, Any]:
    return {
        "name": "transformers",
        "version": getattr(_framework, "__version__", None),
        "per_device_train_batch_size": getattr(args, "per_device_train_batch_size", None),
        "gradient_accumulation_steps": getattr(args, "gradient_accumulation_steps", None),
        "bf16": getattr(args, "bf16", None),
        "fp16": getattr(args, "fp16", None),
        "torch_compile": getattr(args, "torch_compile", None),
        "world_size": getattr(args, "world_size", None),
        "max_steps": getattr(args, "max_steps", None),
    }


class StepdoctorCallback(TrainerCallback):
    """Profiles ``Trainer.train`` on stepdoctor's schedule and ships the traces like ``stepdoctor.profile``."""

    def __init__(self, project: str | None = None, run: str | None = None, **profile_kwargs: Any) -> None:
        self.session = Session(project, run, profile_kwargs)

    @property
    def prof(self) -> Any:
        """The running :class:`stepdoctor.Profile` (None before training starts and after it ends)."""
        return self.session.prof

    @guarded()
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        loader = kwargs.get("train_dataloader")
        self.session.start(
            merged_loader_settings(loader, _known_loader_settings(args)), _trainer_settings(args)
        )

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.stop()
