"""A CPU training loop under ``stepdoctor.profile`` that runs until a file appears, for the
capture-on-demand tests: no scheduled window and no anomaly capture (so any trace is one asked
for), a 1+2-step window when one is asked for, and the agent's poll interval from ``--poll-s``.
With ``--start-file``, the profile starts only once that file exists. Prints one JSON line at exit.

Run as a script (``python tests/support/capture_loop.py ...``); the server and token come from
``STEPDOCTOR_SERVER`` / ``STEPDOCTOR_TOKEN``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import stepdoctor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--project", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--poll-s", type=float, required=True)
    parser.add_argument("--stop-file", type=Path, required=True)
    parser.add_argument("--step-s", type=float, default=0.02)
    parser.add_argument("--max-s", type=float, default=600.0)
    parser.add_argument("--start-file", type=Path, help="start the profile once this file exists")
    args = parser.parse_args()
    deadline = time.monotonic() + args.max_s
    while args.start_file is not None and not args.start_file.exists() and time.monotonic() < deadline:
        if args.stop_file.exists():  # stopped before it started: no profile at all
            print(json.dumps({"steps": 0, "captured": 0}), flush=True)
            return
        time.sleep(0.05)  # torch is imported: the start-up is paid while the test sets up
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    prof = stepdoctor.profile(
        args.project,
        args.run,
        skip_first=10**9,
        warmup=1,
        active=2,
        anomaly_capture=False,
        on_demand_interval=args.poll_s,
    )
    steps = 0
    with prof:
        while not args.stop_file.exists() and time.monotonic() < deadline:
            loss = model(torch.randn(32, 64)).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            time.sleep(args.step_s)
            prof.step()
            steps += 1
    print(json.dumps({"steps": steps, "captured": prof.captured}), flush=True)


if __name__ == "__main__":
    main()
