# The eagle3-airflow image: the official Airflow image (which already has the Celery, Postgres and Redis
# providers the compose file relies on), the control plane's pins, and the code. One image for every Airflow
# component, in docker-compose.yaml or under the KubernetesExecutor: no code is mounted, and paths come from the
# environment (PYTHONPATH), with defaults set here. The DAG's settings are not baked in: they belong to the DAG bundle
# (eagle3_settings.json beside the DAG file in a GitDagBundle) or are mounted (docker-compose.yaml: deploy/settings/,
# named by EAGLE3_DAG_SETTINGS), so a settings change needs no rebuild; without either, the built-in settings.
# The code, compiled: the airflow user cannot write __pycache__ beside code owned by root, so without bytecode made
# here every DAG parse (a fresh child process each time) would compile our modules again: 0.19-0.21 s a parse
# against 0.14-0.15 s compiled, of the 0.25 s budget (read-only copies, this VM). checked-hash: a source mounted
# over them (deploy/docker-compose.dev.yaml) is never served stale bytecode.
FROM apache/airflow:3.3.2 AS code
COPY --chown=airflow:root dags/ /opt/airflow/dags/
COPY --chown=airflow:root plugins/ /opt/airflow/plugins/
COPY --chown=airflow:root include/ /opt/airflow/include/
RUN python -m compileall -q --invalidation-mode checked-hash /opt/airflow/dags /opt/airflow/plugins /opt/airflow/include

FROM apache/airflow:3.3.2

# The image's default user; pip installs into its user site as the Airflow docs require (never as root).
USER airflow

# .dockerignore sends only what is copied here as build context (no .env, keys, tests, .venv or caches).
COPY requirements.txt requirements-image.txt /

# requirements-image.txt: the control plane (Airflow and its providers, pydantic, tenacity, httpx), pinned by
# requirements.txt. apache-airflow==3.3.2 is pinned there too, which keeps pip from moving the image's own Airflow.
RUN pip install --no-cache-dir -r /requirements-image.txt

# EAGLE3_LOCAL_BOX=1: the stages themselves on the worker (the `local` box, a CPU demo), so their stack too.
# torch first, from the CPU wheel index: PyPI's Linux wheel would pull several GB of CUDA libraries. The pins are
# read from requirements.txt, so there is one place to bump them.
ARG EAGLE3_LOCAL_BOX=""
RUN if [ -n "$EAGLE3_LOCAL_BOX" ]; then \
        pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu \
            "$(grep -E '^torch==' /requirements.txt)" \
        && pip install --no-cache-dir -c /requirements.txt \
            transformers tokenizers safetensors numpy matplotlib tensorboard; \
    fi

# The code and its bytecode, read-only to the airflow user (owned by root): the DAG, the plugin, the box-side package
# (which the DAG imports as `eagle3` and syncs to the box, bytecode left out) and the compose stack's role script.
# Of deploy/, only that script: deploy/settings/ is mounted, and a copy in the image would be a second, stale one.
COPY --from=code /opt/airflow/dags/ /opt/airflow/dags/
COPY --from=code /opt/airflow/plugins/ /opt/airflow/plugins/
COPY --from=code /opt/airflow/include/ /opt/airflow/include/
COPY deploy/fab_roles.py /opt/airflow/deploy/

ENV PYTHONPATH=/opt/airflow/include
