"""One-line agent placement in the trainers people use: add ``StepdoctorCallback(...)`` to
``callbacks=[...]`` and get the same schedule, metadata and delivery as :func:`stepdoctor.profile`.

- :mod:`stepdoctor.integrations.lightning` — PyTorch Lightning (``pip install 'stepdoctor[lightning]'``)
- :mod:`stepdoctor.integrations.transformers` — Hugging Face ``Trainer``
  (``pip install 'stepdoctor[transformers]'``)
- :mod:`stepdoctor.integrations.accelerate` — Hugging Face Accelerate loops:
  ``with StepdoctorAccelerate(accelerator, ...)`` (``pip install 'stepdoctor[accelerate]'``)

With a W&B or MLflow run active in the process, each of them also logs the verdict of every
analysed window into it (:mod:`stepdoctor.integrations.trackers`).

Each module imports its framework; the agent itself never does.
"""
