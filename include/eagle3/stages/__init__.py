"""The pipeline's stages, a module or package each (`python -m eagle3 <stage> --config RUN_DIR/config.json`), and the
two they share: the split of the data (split.py) and the promotion policy (promote.py)."""
