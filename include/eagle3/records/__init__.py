"""The records a run keeps besides its files: training checkpoints (save, list, load, the best), and a lineage
(drafters/<key>: the pinned evaluation set, versions, `current`, the weights digest)."""
