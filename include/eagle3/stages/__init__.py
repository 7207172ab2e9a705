"""The pipeline's stages, one module each: `python -m eagle3 <stage> --config RUN_DIR/config.json`."""
