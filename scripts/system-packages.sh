#!/usr/bin/env bash
# What the test suite drives for real and pip cannot install, installed from Debian's packages if missing
# (`make test` runs this first, so the README's command alone passes on a fresh machine; .ci/run calls make test):
#   openssh-server  the loopback sshd of the SSH tests (tests/sshd.py)
#   docker-compose  Debian's 1.29, no engine: tests/test_compose.py only runs `docker-compose config`
#   chromium        the web UI test (tests/ui/), driven through Playwright at /usr/bin/chromium (no browser download)
#   postgresql, redis-server, iproute2
#                   the production-topology test (tests/test_production_airflow.py): Airflow's metadata database,
#                   the Celery broker, and the network namespace of its second Celery worker (`ip netns`)
# Installs only what is missing, so a rerun touches apt not at all.
set -euo pipefail

missing=()
command -v sshd >/dev/null || [ -x /usr/sbin/sshd ] || missing+=(openssh-server)
command -v docker-compose >/dev/null || missing+=(docker-compose)
[ -x /usr/bin/chromium ] || missing+=(chromium)
compgen -G '/usr/lib/postgresql/*/bin/postgres' >/dev/null || missing+=(postgresql)
command -v redis-server >/dev/null || missing+=(redis-server)
command -v ip >/dev/null || missing+=(iproute2)
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -eq 0 ]; then
    as_root=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
else
    echo "make test needs these Debian packages, which are missing: ${missing[*]}" >&2
    echo "Install them as root, then run make test again: apt-get install -y --no-install-recommends ${missing[*]}" >&2
    exit 1
fi
echo "installing the system packages the tests drive for real: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
