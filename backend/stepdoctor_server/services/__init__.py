"""Domain services: the queries behind each view, shared by the JSON API and the dashboard.

Datasette's pattern: one function reads (or queues) what a view shows, scoped to the caller's
team (another team's row is a 404, never a 403), and the API router renders it as JSON while the
dashboard renders it as a page. Nothing here knows about pydantic response models or templates.

- :mod:`.traces`: one trace, its stored analysis and report, its download.
- :mod:`.runs`: one run, its diagnosis and trace counts, the TensorBoard export; the API's catalog
  (projects, filtered runs, a run's traces) and the dashboard's lists, run facts and comparison context.
- :mod:`.deep`: the optional HTA analyses of a trace.
"""
