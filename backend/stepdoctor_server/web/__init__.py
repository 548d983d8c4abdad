"""The HTTP layer: the app factory, the JSON API routers, the dashboard pages and their middleware; each page and its JSON twin read one domain service."""
