"""The team dashboard: server-rendered pages over the same data and permissions as the REST API.

Figures are built in Python (``figures``) and drawn by the plotly.js that ships inside the installed
``plotly`` package, so the dashboard works offline. ``routes.install(app)`` mounts it.
"""
