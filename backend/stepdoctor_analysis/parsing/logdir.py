"""A TensorBoard log directory: one folder per run, each holding that run's trace files.

``torch.profiler.tensorboard_trace_handler(dir)`` writes ``{worker}.{time}.pt.trace.json[.gz]``
files, and users keep one folder per run under a common log dir (anchors §2: any folder holding
trace files is a run, named by its path relative to the log dir). ``stepdoctor analyze LOGDIR``
then has several runs to report on, not one job; ``runs`` finds them.
"""

from __future__ import annotations

from pathlib import Path

TRACE_SUFFIXES = (".json", ".json.gz")
MAX_DEPTH = 4  # log dirs nest run folders a few levels deep (project/run/attempt), not more


def has_traces(folder: Path) -> bool:
    """The folder itself holds trace files (``.json``/``.json.gz``)."""
    return any(f.is_file() and f.name.endswith(TRACE_SUFFIXES) for f in folder.iterdir())


def runs(logdir: Path) -> list[tuple[str, Path]]:
    """(run name, folder) of every folder under ``logdir`` that holds trace files, sorted by name.

    ``logdir`` itself is not a run here: a folder with trace files directly inside is one job.
    """
    found: list[tuple[str, Path]] = []

    def walk(folder: Path, depth: int) -> None:
        for child in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
            if has_traces(child):
                found.append((child.relative_to(logdir).as_posix(), child))
            elif depth < MAX_DEPTH:
                walk(child, depth + 1)

    walk(logdir, 1)
    return found
