"""stepdoctor: find out why your PyTorch training step is slow.

import stepdoctor
with stepdoctor.profile(project="resnet50", run="bs256") as prof:
    for batch in loader:
        train_step(batch)
        prof.step()
"""

__version__ = "0.1.0"

from stepdoctor.profiler import NoopProfile, Profile, profile

__all__ = ["NoopProfile", "Profile", "__version__", "profile"]
