"""The recipe: the typed schema by section, YAML + dotted overrides, paths, errors worded for users.

Imports only `accord.errors` and `accord.registry`."""
