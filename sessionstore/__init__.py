"""Persistence and the session service: the ``.coli_kv`` file, sessions, the store, migration."""
