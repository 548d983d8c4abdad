"""One line in a Lightning or Hugging Face ``Trainer(callbacks=[...])``: the real frameworks on CPU,
a tiny model, a few steps, and the traces (with ProfilerStep markers and the trainer's DataLoader
settings) delivered like ``stepdoctor.profile`` delivers them."""

from __future__ import annotations

import contextlib
import gzip
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from stepdoctor.spool import META_SUFFIX, TRACE_SUFFIX
from support.fake_server import TOKEN, FakeServer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

# skip 1, warm up 1, record 2, twice: windows record steps 2-3 and 5-6
SCHEDULE = {"skip_first": 1, "warmup": 1, "active": 2, "repeat": 2}


@pytest.fixture(autouse=True)
def _raise_agent_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPDOCTOR_RAISE_ERRORS", "1")
    for var in (
        "STEPDOCTOR_SERVER",
        "STEPDOCTOR_TOKEN",
        "STEPDOCTOR_SPOOL",
        "STEPDOCTOR_RUN",
        "RANK",
        "WORLD_SIZE",
    ):
        monkeypatch.delenv(var, raising=False)


def step_numbers(trace: dict[str, Any]) -> list[int]:
    names = (e.get("name", "") for e in trace["traceEvents"])
    return sorted(int(m.group(1)) for n in names if (m := re.fullmatch(r"ProfilerStep#(\d+)", n)))


def spooled(run_dir: Path) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(sidecar, trace) of each capture in a local run directory, in window order."""
    out = []
    for sidecar in run_dir.glob(f"*{META_SUFFIX}"):
        trace = sidecar.with_name(sidecar.name[: -len(META_SUFFIX)] + TRACE_SUFFIX)
        out.append((json.loads(sidecar.read_text()), json.loads(gzip.decompress(trace.read_bytes()))))
    return sorted(out, key=lambda pair: pair[0]["window"]["index"])


def check_windows(windows: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    assert len(windows) == 2
    for index, (meta, trace) in enumerate(windows):
        first, last = 2 + 3 * index, 3 + 3 * index
        assert (meta["window"]["first_step"], meta["window"]["last_step"]) == (first, last)
        assert step_numbers(trace) == [first, last]


# -- PyTorch Lightning ---------------------------------------------------------------------------


def tiny_module(pl: Any, *, fail_at: int | None = None) -> Any:
    """A one-layer LightningModule; ``fail_at``: the batch whose training step raises."""

    class Tiny(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if batch_idx == fail_at:
                raise RuntimeError("diverged")
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Tiny()


def cpu_trainer(pl: Any, callback: Any) -> Any:
    return pl.Trainer(
        max_steps=9,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )


def test_lightning_callback(tmp_path: Path) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from stepdoctor.integrations.lightning import StepdoctorCallback

    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    loader = DataLoader(data, batch_size=4, num_workers=1, persistent_workers=True, pin_memory=False)
    callback = StepdoctorCallback("pl", "tiny", spool=tmp_path, tags={"team": "vision"}, **SCHEDULE)
    trainer = cpu_trainer(pl, callback)
    trainer.fit(tiny_module(pl), loader)
    assert callback.prof is None  # stopped at the end of fit

    windows = spooled(tmp_path / "pl" / "tiny")
    check_windows(windows)
    meta = windows[0][0]["metadata"]
    assert meta["loader"] == {
        "batch_size": 4,
        "num_workers": 1,
        "pin_memory": False,
        "prefetch_factor": 2,
        "persistent_workers": True,
        "type": "DataLoader",
    }
    framework = meta["framework"]
    assert framework["name"] == "lightning" and framework["max_steps"] == 9
    assert framework["accumulate_grad_batches"] == 1 and framework["devices"] == 1
    assert meta["tags"] == {"team": "vision"} and meta["torch"] == torch.__version__


# -- Hugging Face transformers -------------------------------------------------------------------


class Pairs(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, count: int) -> None:
        self.x, self.y = torch.randn(count, 8), torch.randn(count, 1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "labels": self.y[index]}


class Regressor(torch.nn.Module):
    """The smallest model the Trainer drives: keyword inputs in, a dict with ``loss`` out."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = self.layer(x)
        loss = torch.nn.functional.mse_loss(out, labels) if labels is not None else out.sum()
        return {"loss": loss, "logits": out}


def test_transformers_callback_delivers_to_the_server(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from stepdoctor.integrations.transformers import StepdoctorCallback

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=9,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    with FakeServer() as server:
        callback = StepdoctorCallback(
            "hf", "tiny", spool=tmp_path / "spool", server=server.url, token=TOKEN, **SCHEDULE
        )
        trainer = transformers.Trainer(
            model=Regressor(), args=args, train_dataset=Pairs(128), callbacks=[callback]
        )
        trainer.train()
        uploads = sorted(server.uploads.values(), key=lambda u: u.metadata["window"]["index"])
    assert [(u.project, u.run) for u in uploads] == [("hf", "tiny")] * 2
    check_windows([({"window": u.metadata["window"]}, u.trace) for u in uploads])
    meta = uploads[0].metadata
    assert meta["loader"]["batch_size"] == 4 and meta["loader"]["num_workers"] == 0
    assert meta["loader"]["pin_memory"] is False and meta["loader"]["persistent_workers"] is False
    framework = meta["framework"]
    assert framework["name"] == "transformers" and framework["gradient_accumulation_steps"] == 2
    assert framework["per_device_train_batch_size"] == 4
    assert not list((tmp_path / "spool").glob(f"*/*/*{META_SUFFIX}"))  # nothing left to send


def test_callbacks_refuse_options_they_set_themselves() -> None:
    pytest.importorskip("transformers")
    from stepdoctor.integrations.transformers import StepdoctorCallback

    with pytest.raises(TypeError, match="DataLoader"):
        StepdoctorCallback("p", "r", loader=[1, 2])


# -- how training ended: the step series' last chunk says whether the loop raised ---------------


def last_chunk_clean(run_dir: Path) -> bool:
    """``clean_exit`` of the final series chunk in a local run directory (what liveness reads)."""
    from stepdoctor_analysis.run.timeline import series_files, validate_chunk

    chunks = [validate_chunk(path.read_bytes()) for path in series_files(run_dir)]
    finals = [c for c in chunks if c.header.get("final")]
    assert len(finals) == 1, [c.header for c in chunks]
    return bool(finals[0].header["clean_exit"])


@pytest.mark.parametrize("fail_at", [None, 5])
def test_lightning_failure_is_not_a_clean_exit(tmp_path: Path, fail_at: int | None) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from stepdoctor.integrations.lightning import StepdoctorCallback

    loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=4)
    callback = StepdoctorCallback("pl", "ends", spool=tmp_path, **SCHEDULE)
    trainer = cpu_trainer(pl, callback)
    if fail_at is None:
        trainer.fit(tiny_module(pl, fail_at=fail_at), loader)
    else:
        with pytest.raises(RuntimeError, match="diverged"):
            trainer.fit(tiny_module(pl, fail_at=fail_at), loader)
    assert callback.prof is None
    assert last_chunk_clean(tmp_path / "pl" / "ends") is (fail_at is None)


@pytest.mark.parametrize("fail", [False, True])
def test_accelerate_failure_is_not_a_clean_exit(tmp_path: Path, fail: bool) -> None:
    accelerate = pytest.importorskip("accelerate")
    from stepdoctor.integrations.accelerate import StepdoctorAccelerate

    accelerator = accelerate.Accelerator(cpu=True)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=4))
    expected = pytest.raises(RuntimeError) if fail else contextlib.nullcontext()
    with expected, StepdoctorAccelerate(accelerator, "acc", "ends", spool=tmp_path, **SCHEDULE):
        for index, (x, y) in enumerate(loader):
            if fail and index == 5:
                raise RuntimeError("diverged")
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    assert last_chunk_clean(tmp_path / "acc" / "ends") is not fail
