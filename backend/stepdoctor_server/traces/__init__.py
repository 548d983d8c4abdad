"""One trace: its upload (ingest), its bytes (storage), its stored report (reports), trimmed downloads, and the service pages and the API read it through."""
