#!/usr/bin/env bash
# The installed wheel: build the sdist and, from it, the wheel, out of a clean copy of the source
# tree (the files git tracks or would track); install the wheel (with the test
# and numba extras) into a fresh virtual environment; then, from a folder where the source tree
# is not importable, check that every CUDA source is inside the installed package, run the
# conformance suite on the numpy and array_api backends and compile numba's float32 kernels.
# An editable install hides missing package data; this does not.
#
# Usage: scripts/check_wheel.sh [PYTHON]      PYTHON (default python3) needs `build` installed:
#                                             python3 -m pip install build
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
python=${1:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "== copy the source tree as git sees it (no stale build/ or *.egg-info to borrow files from)"
mkdir "$work/src"
(
    cd "$root"
    git ls-files -z --cached --others --exclude-standard \
        | while IFS= read -r -d '' file; do [ -e "$file" ] && printf '%s\0' "$file"; done \
        | tar --null -T - -cf -
) | tar -xf - -C "$work/src"

echo "== build the sdist, then the wheel from the sdist"
"$python" -m build --outdir "$work/dist" "$work/src"
sdist=$(ls "$work"/dist/normlab-*.tar.gz)
wheel=$(ls "$work"/dist/normlab-*.whl)

kernels=$(cd "$root/normlab/backends/kernels" && ls)
echo "== the sdist and the wheel hold every kernel source: $(echo $kernels)"
in_sdist=$(tar -tzf "$sdist")
in_wheel=$("$python" -m zipfile -l "$wheel")
for name in $kernels; do
    grep -q "/normlab/backends/kernels/$name\$" <<<"$in_sdist" \
        || { echo "the sdist lacks normlab/backends/kernels/$name"; exit 1; }
    grep -q "^normlab/backends/kernels/$name " <<<"$in_wheel" \
        || { echo "the wheel lacks normlab/backends/kernels/$name"; exit 1; }
done

echo "== install the wheel into a fresh virtual environment"
"$python" -m venv "$work/venv"
venv_python="$work/venv/bin/python"
"$venv_python" -m pip install --quiet --upgrade pip
"$venv_python" -m pip install --quiet --no-compile "$wheel[test,numba]"

cd "$work"  # not the source tree: only the installed package can be imported
export NORMLAB_CACHE_DIR="$work/normlab-cache"
unset PYTHONPATH NORMLAB_BACKEND NORMLAB_PLUGINS NUMBA_CACHE_DIR
echo "== the installed package, not the source tree, is imported; its kernels are all there"
"$venv_python" - "$work/venv" $kernels <<'EOF'
import pathlib
import sys

import normlab

venv, expected = pathlib.Path(sys.argv[1]).resolve(), sorted(sys.argv[2:])
package = pathlib.Path(normlab.__file__).resolve().parent
assert package.is_relative_to(venv), f"normlab was imported from {package}, not the venv"
installed = sorted(p.name for p in (package / "backends" / "kernels").iterdir())
assert installed == expected, f"installed kernels {installed}, source tree {expected}"
print(f"normlab {normlab.__version__} from {package}; kernels: {', '.join(installed)}")
EOF

for backend in numpy array_api; do
    echo "== conformance suite on $backend, from the installed wheel"
    "$venv_python" -m normlab check "$backend" -- -q
done
# numba's kernels compile from the installed package and are cached outside it: the float32
# forward kernels, serial and parallel, contiguous and strided (every kernel module is imported
# with the backend; the suite on numba, every kernel, runs in the tests sessions from the same
# files).
echo "== numba's float32 forward kernels compile from the installed wheel"
"$venv_python" -m normlab warmup --dtypes float32 --ops forward
echo "== the kernels were cached in \$NORMLAB_CACHE_DIR/numba, nothing in the installed package"
package=$("$venv_python" -c 'import normlab, pathlib; print(pathlib.Path(normlab.__file__).parent)')
written=$(find "$package" -name '*.nbi' -o -name '*.nbc')
[ -z "$written" ] || { echo "kernel caches inside the installed package: $written"; exit 1; }
find "$NORMLAB_CACHE_DIR/numba" -name '*.nbi' | grep -q . \
    || { echo "no kernel cached in $NORMLAB_CACHE_DIR/numba"; exit 1; }
echo "== the wheel is complete"
