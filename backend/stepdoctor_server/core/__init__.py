"""Settings, the database (engine, sessions, models, migrations) and the API's error type: what every domain stands on."""
