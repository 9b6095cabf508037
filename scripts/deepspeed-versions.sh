#!/usr/bin/env bash
# The CPU parity subset (tests/e2e/test_deepspeed_versions.py) against each DeepSpeed release given,
# by default the latest patch of each supported minor release:
#   bash scripts/deepspeed-versions.sh [VERSION...]
# Per release, a virtual environment .venvs/deepspeed-VERSION (git-ignored, kept for the next run)
# that sees the packages of the Python running this script (PYTHON, default python3) through a .pth
# file, so torch and the rest are not installed again, and holds only that DeepSpeed itself (built
# from DeepSpeed's source archive, whose setup.py imports torch: no build isolation). The release
# fails if that environment imports another DeepSpeed. Ends with a line per release, passed or
# failed and the seconds taken; exits 1 if any failed. Two runs at once must not share a release.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ $# -gt 0 ] && versions=("$@") || versions=(0.16.9 0.17.6 0.18.9 0.19.8)
base=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || exit 1
summary=()
failed=0

# The DeepSpeed an environment imports: "VERSION own|outside FILE", own when it lies inside that
# environment (DeepSpeed may print log lines before it).
imported() {
    "$1" -c 'import os, sys, deepspeed
where = "own" if deepspeed.__file__.startswith(sys.prefix + os.sep) else "outside"
print("imported", deepspeed.__version__, where, deepspeed.__file__)' 2>/dev/null | sed -n 's/^imported //p'
}

for v in "${versions[@]}"; do
    t0=$SECONDS
    venv=.venvs/deepspeed-$v
    vpy=$venv/bin/python
    echo "=== DeepSpeed $v in $venv"
    if [ ! -x "$vpy" ]; then
        "$PY" -m venv --without-pip "$venv" || exit 1
    fi
    site=$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || exit 1
    # addsitedir: the base's own .pth files (setuptools' distutils shim, editable installs) apply too
    echo "import site; site.addsitedir('$base')" > "$site/_base_environment.pth"
    got=$(imported "$vpy")
    if [[ "$got" != "$v own "* ]]; then
        # --ignore-installed: the base's DeepSpeed is visible here, and must stay where it is
        "$vpy" -m pip install -q --no-deps --no-build-isolation --ignore-installed "deepspeed==$v" || {
            summary+=("deepspeed $v: FAILED to install ($((SECONDS - t0)) s)"); failed=1; continue; }
        got=$(imported "$vpy")
    fi
    echo "imports DeepSpeed ${got:-nothing}"
    if [[ "$got" != "$v own "* ]]; then
        summary+=("deepspeed $v: FAILED, the environment imports DeepSpeed ${got:-nothing}, not its own $v")
        failed=1
        continue
    fi
    t1=$SECONDS
    # The ranks' JIT ops (the CPU's shm all-reduce) build from this release's sources, into the
    # environment; a lock left by a killed build would make the next build wait forever.
    ext=$PWD/$venv/torch_extensions
    find "$ext" -name lock -delete 2>/dev/null
    DS_OFFLOAD_EXPECT_DEEPSPEED=$v TORCH_EXTENSIONS_DIR=$ext PYTHONPATH=$PWD \
        "$vpy" -m pytest tests/e2e/test_deepspeed_versions.py -q -rs -p no:cacheprovider
    rc=$?
    took="$((SECONDS - t0)) s: environment $((t1 - t0)) s, tests $((SECONDS - t1)) s"
    if [ $rc -eq 0 ]; then
        summary+=("deepspeed $v: passed ($took)")
    else
        summary+=("deepspeed $v: FAILED, pytest exit $rc ($took)")
        failed=1
    fi
done

echo "=== DeepSpeed releases"
printf '%s\n' "${summary[@]}"
exit $failed
