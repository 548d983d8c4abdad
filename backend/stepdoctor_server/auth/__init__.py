"""API tokens (scopes, teams) and the dashboard's cookie sessions."""
