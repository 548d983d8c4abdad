"""Hugging Face Accelerate loops: one line after ``accelerator.prepare(...)``.

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with StepdoctorAccelerate(accelerator, project="p", run="r"):
        for batch in loader:
            ...
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()

An Accelerate loop is the user's own code, with no callbacks to hang on; what every training loop
under Accelerate does have is the prepared optimizer. So a profiler step is one *real* optimizer
step: a post-step hook on each prepared optimizer's inner optimizer, which runs only when
Accelerate syncs gradients, so gradient accumulation's micro-batches are inside the step, as in
the Hugging Face ``Trainer`` callback. A loop without an optimizer (evaluation, inference) calls
:meth:`StepdoctorAccelerate.step` itself. The prepared DataLoader's settings and the accelerator's
(mixed precision, distributed type, processes, accumulation) go with every trace. Any
:func:`stepdoctor.profile` keyword (``skip_first``, ``every``, ``server``, ...) passes through.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

try:
    import accelerate as _framework
except ImportError as exc:
    raise ImportError(
        "stepdoctor.integrations.accelerate needs Hugging Face Accelerate: pip install 'stepdoctor[accelerate]'"
    ) from exc

from stepdoctor.guard import guarded
from stepdoctor.integrations._session import Session, merged_loader_settings

__all__ = ["StepdoctorAccelerate"]


def _accelerator_settings(accelerator: Any) -> dict[str, Any]:
    state = getattr(accelerator, "state", None)
    return {
        "name": "accelerate",
        "version": getattr(_framework, "__version__", None),
        "mixed_precision": str(getattr(accelerator, "mixed_precision", None)),
        "distributed_type": str(getattr(state, "distributed_type", None)),
        "num_processes": getattr(accelerator, "num_processes", None),
        "gradient_accumulation_steps": getattr(accelerator, "gradient_accumulation_steps", None),
        "device": str(getattr(accelerator, "device", None)),
    }


def _inner(optimizer: Any) -> Any:
    """The torch optimizer an ``AcceleratedOptimizer`` wraps (or the optimizer itself)."""
    return getattr(optimizer, "optimizer", optimizer)


class StepdoctorAccelerate:
    """Profiles an Accelerate training loop on stepdoctor's schedule; see the module docstring."""

    def __init__(
        self, accelerator: Any, project: str | None = None, run: str | None = None, **profile_kwargs: Any
    ) -> None:
        self.accelerator = accelerator
        self.session = Session(project, run, profile_kwargs)
        self._hooks: list[Any] = []

    @property
    def prof(self) -> Any:
        """The running :class:`stepdoctor.Profile` (None before :meth:`start` and after :meth:`stop`)."""
        return self.session.prof

    @guarded()
    def start(self) -> StepdoctorAccelerate:
        """Start profiling; call after ``accelerator.prepare`` so the optimizers and loader are known."""
        loaders = list(getattr(self.accelerator, "_dataloaders", []) or [])
        loader = loaders[0] if loaders else None
        known = {"batch_size": getattr(loader, "total_batch_size", None)} if loader is not None else {}
        self.session.start(merged_loader_settings(loader, known), _accelerator_settings(self.accelerator))
        for optimizer in getattr(self.accelerator, "_optimizers", []) or []:
            self._hooks.append(_inner(optimizer).register_step_post_hook(self._after_optimizer_step))
        return self

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.session.step()

    def step(self) -> None:
        """Mark the end of a step in a loop with no prepared optimizer (evaluation, inference)."""
        self.session.step()

    @guarded()
    def stop(self, *, clean: bool = True) -> None:
        """Stop profiling and deliver the traces (also done at interpreter exit); ``clean=False``:
        the loop ended with an exception."""
        hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook.remove()
        self.session.stop(clean=clean)

    def __enter__(self) -> StepdoctorAccelerate:
        return self.start() or self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop(clean=kind is None)
