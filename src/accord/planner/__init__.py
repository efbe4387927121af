"""`accord plan`: memory per rank for each strategy, and which fits.

Imports recipe, distributed, models and engine; nothing imports it but cli and api."""
