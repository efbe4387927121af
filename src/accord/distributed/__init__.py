"""Process-group state, the launcher's rank layout, and the batch arithmetic (BatchPlan).

Imports the recipe layer and torch.distributed; nothing above it."""
