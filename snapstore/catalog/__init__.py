"""The catalog: SQLite connections, transactions and migrations, and every query snapstore runs on its tables.

Internal: the public API is what :mod:`snapstore` exports."""
