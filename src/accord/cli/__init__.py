"""The `accord` command: one module per command group; parses, calls the library, prints.

May import every other layer; nothing imports it but `accord.api`'s callers."""
