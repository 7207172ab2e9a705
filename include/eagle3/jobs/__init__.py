"""Detached, re-attachable jobs on the box, their progress beats, and the Airflow run that owns a run
directory. Light: `job poll` runs every few seconds for hours."""
