"""eagle3: the box-side pipeline that turns a target LLM into an EAGLE-3 drafter.

Runs on the GPU box as ``python -m eagle3 <stage> --config <run dir>/config.json``.
This package never imports Airflow, and importing it (or ``eagle3.config``) stays light: no torch,
no transformers. Heavy imports live inside the stage modules, so the Airflow DAG can import
``eagle3.config`` at parse time.
"""

__version__ = "0.1.0"
