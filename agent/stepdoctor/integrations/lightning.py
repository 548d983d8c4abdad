"""PyTorch Lightning: ``Trainer(callbacks=[StepdoctorCallback(project="p", run="r")])``.

One profiler step per training batch (``on_train_batch_end``), as Lightning's own profilers count;
the train DataLoader's settings and the trainer's (precision, strategy, devices, accumulation) go
with every trace. Any :func:`stepdoctor.profile` keyword (``skip_first``, ``every``, ``server``,
``tags``, ``profiler_kwargs``...) passes through.
"""

from __future__ import annotations

from typing import Any

try:
    import lightning as _framework
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the older package name
    try:
        import pytorch_lightning as _framework  # type: ignore[no-redef]
        from pytorch_lightning.callbacks import Callback  # type: ignore[assignment]
    except ImportError as exc:
        raise ImportError(
            "stepdoctor.integrations.lightning needs PyTorch Lightning: pip install 'stepdoctor[lightning]'"
        ) from exc

from stepdoctor.guard import guarded
from stepdoctor.integrations._session import Session, merged_loader_settings

__all__ = ["StepdoctorCallback"]


def _train_loader(trainer: Any) -> Any:
    """The (first) train DataLoader: Lightning accepts one, or a list/dict of them."""
    loaders = getattr(trainer, "train_dataloader", None)
    if isinstance(loaders, dict):
        loaders = next(iter(loaders.values()), None)
    elif isinstance(loaders, (list, tuple)):
        loaders = loaders[0] if loaders else None
    return loaders


def _trainer_settings(trainer: Any) -> dict[str, Any]:
    return {
        "name": "lightning",
        "version": getattr(_framework, "__version__", None),
        "precision": str(getattr(trainer, "precision", None)),
        "strategy": type(getattr(trainer, "strategy", None)).__name__,
        "devices": getattr(trainer, "num_devices", None),
        "num_nodes": getattr(trainer, "num_nodes", None),
        "accumulate_grad_batches": getattr(trainer, "accumulate_grad_batches", None),
        "max_steps": getattr(trainer, "max_steps", None),
        "max_epochs": getattr(trainer, "max_epochs", None),
    }


class StepdoctorCallback(Callback):
    """Profiles ``trainer.fit`` on stepdoctor's schedule and ships the traces like ``stepdoctor.profile``."""

    def __init__(self, project: str | None = None, run: str | None = None, **profile_kwargs: Any) -> None:
        super().__init__()
        self.session = Session(project, run, profile_kwargs)

    @property
    def prof(self) -> Any:
        """The running :class:`stepdoctor.Profile` (None before ``fit`` starts and after it ends)."""
        return self.session.prof

    @guarded()
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        loader = _train_loader(trainer)
        self.session.start(merged_loader_settings(loader, {}), _trainer_settings(trainer))

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.session.step()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.session.stop()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.session.stop(clean=False)  # keep what was captured before the failure
