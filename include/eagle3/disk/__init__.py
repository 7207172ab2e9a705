"""Files on the box: every path inside a work directory, a run directory and a lineage, named once; atomic writes,
journal appends and locks; the host id. The bottom layer: no torch, no pydantic, no other eagle3 module."""
