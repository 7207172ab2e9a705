# Control-plane image for docker-compose.yaml: the official Airflow image (which already has the Celery, Postgres
# and Redis providers the compose file relies on) plus this project's pins. DAGs, plugins and include/ are
# mounted, not copied, so code changes need no rebuild; requirements.txt changes do (`docker-compose build`).
FROM apache/airflow:3.3.2

# The image's default user; pip installs into its user site as the Airflow docs require (never as root).
USER airflow

# .dockerignore sends only requirements.txt as build context (no .env, keys, .venv or caches).
COPY requirements.txt /requirements.txt

# requirements.txt is the CPU stack this repo tests with (torch, transformers, pytest): heavier than a control
# plane needs, but it lets the worker run the `local` box and keeps one set of pins. torch first, from the CPU
# wheel index: PyPI's Linux wheel would pull several GB of CUDA libraries nothing here uses. The pin is read
# from requirements.txt, so there is one place to bump it; the second install then finds torch satisfied.
# apache-airflow==3.3.2 is pinned there too, which keeps pip from moving the image's own Airflow.
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu \
        "$(grep -E '^torch==' /requirements.txt)" \
    && pip install --no-cache-dir -r /requirements.txt
