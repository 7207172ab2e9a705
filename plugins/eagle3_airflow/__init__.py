"""The Airflow side of eagle3-airflow (plugins/README.md lists its modules). Never imported by the box."""

DAG_ID = "eagle3_drafter"  # the DAG's id: the run note and the report view find its runs by it
