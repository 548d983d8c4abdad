"""One-line agent placement in the trainers people use: add ``StepdoctorCallback(...)`` to
``callbacks=[...]`` and get the same schedule, metadata and delivery as :func:`stepdoctor.profile`.

- :mod:`stepdoctor.integrations.lightning` — PyTorch Lightning (``pip install 'stepdoctor[lightning]'``)
- :mod:`stepdoctor.integrations.transformers` — Hugging Face ``Trainer``
  (``pip install 'stepdoctor[transformers]'``)

Each module imports its framework; the agent itself never does.
"""
