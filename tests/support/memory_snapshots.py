"""A file shaped like a CUDA memory snapshot, for tests on machines without a GPU."""

from __future__ import annotations

from typing import Any


def snapshot_shaped(allocations: int = 50) -> dict[str, Any]:
    """What ``torch.cuda.memory._snapshot()`` returns, in miniature: allocator segments and each
    device's allocation events with their stack frames."""
    frames = [{"filename": "train.py", "line": 40 + i, "name": f"step{i}"} for i in range(3)]
    return {
        "segments": [
            {
                "device": 0,
                "address": 139_000_000 + k * 2**21,
                "total_size": 2**21,
                "allocated_size": 2**20,
                "active_size": 2**20,
                "requested_size": 2**20,
                "stream": 0,
                "segment_type": "large",
                "blocks": [
                    {"size": 2**20, "requested_size": 2**20, "state": "active_allocated", "frames": frames}
                ],
            }
            for k in range(4)
        ],
        "device_traces": [
            [
                {
                    "action": "alloc",
                    "addr": 139_000_000 + i * 512,
                    "size": 512,
                    "stream": 0,
                    "time_us": i,
                    "frames": frames,
                }
                for i in range(allocations)
            ]
        ],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": ""},
    }
